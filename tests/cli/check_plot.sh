#!/bin/sh
# check_plot.sh WORKDIR COMMAND...
# The SVG plot of `kvpager simulate --plot` labels all three axes (scheduler
# step, pages in use, running sequences) at round steps: for runs from one
# request to a few hundred steps, each axis's tick labels must be 0, s, 2s,
# ... with s = 1, 2 or 5 x 10^k, drawn at evenly spaced positions, and the
# last label must reach the axis's largest value.
set -eu
work=$1
shift
mkdir -p "$work"
fail() { echo "check_plot: $*" >&2; exit 1; }

n=0
for run in "--requests 1 --prompt-mean 2 --output-mean 3 --capacity 8 --budget 16KiB" \
           "--requests 4 --prompt-mean 8 --output-mean 8 --capacity 64 --budget 32KiB" \
           "--requests 12 --prompt-mean 20 --output-mean 20 --capacity 128 --budget 256KiB" \
           "--requests 60 --prompt-mean 30 --output-mean 40 --capacity 256 --budget 1MiB"; do
    n=$((n + 1))
    # shellcheck disable=SC2086
    "$@" simulate $run --no-compute --quiet --json --plot "$work/plot$n.svg" > "$work/run$n.json" \
        || fail "run $n failed: $run"
    python3 - "$work/plot$n.svg" "$work/run$n.json" <<'PY' || fail "run $n ($run): bad ticks"
import json, math, re, sys
svg = open(sys.argv[1]).read()
run = json.load(open(sys.argv[2]))
def ticks(cls, coord):
    found = re.findall(r'<text class="%s" x="([-\d.]+)" y="([-\d.]+)"[^>]*>([^<]*)</text>' % cls, svg)
    assert found, "no %s labels" % cls
    return [(float(x if coord == "x" else y), float(label)) for x, y, label in found]
def round_step(s):
    k = math.floor(math.log10(s))
    return any(abs(s - f * 10 ** k) < 1e-9 for f in (1, 2, 5))
largest = {"tick-x": run["steps"] - 1, "tick-left": run["total_pages"],
           "tick-right": run["peak_concurrent_sequences"]}
for cls, coord in (("tick-x", "x"), ("tick-left", "y"), ("tick-right", "y")):
    t = ticks(cls, coord)
    labels = [v for _, v in t]
    assert len(labels) >= 2, (cls, labels)
    step = labels[1] - labels[0]
    assert labels[0] == 0 and step >= 1 and round_step(step), (cls, labels)
    assert all(abs(b - a - step) < 1e-9 for a, b in zip(labels, labels[1:])), (cls, labels)
    gaps = [b[0] - a[0] for a, b in zip(t, t[1:])]
    assert max(gaps) - min(gaps) < 0.2, (cls, "uneven positions", gaps)
    assert labels[-1] >= largest[cls] and labels[-1] - step < max(largest[cls], 1), \
        (cls, labels, largest[cls])
    print("%s %s: %s" % (sys.argv[1].rsplit("/", 1)[-1], cls, " ".join("%g" % v for v in labels)))
PY
done
echo "check_plot: ok"
