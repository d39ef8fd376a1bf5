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
# Every series is in the legend, running sequences included; a sharing
# workload draws its run without sharing too (dashed held pages and running
# sequences), on axes that cover both runs, and the legend says so.
"$@" simulate --requests 6 --prompt-mean 12 --output-mean 8 --capacity 64 --samples 2 \
    --no-compute --quiet --json --plot "$work/sharing.svg" > "$work/sharing.json" ||
    fail "the sharing run failed"
"$@" simulate --requests 6 --prompt-mean 12 --output-mean 8 --capacity 64 --no-compute \
    --quiet --json --plot "$work/plain.svg" > "$work/plain.json" || fail "the plain run failed"
python3 - "$work/sharing.svg" "$work/sharing.json" "$work/plain.svg" <<'PY' || fail "the legend or the runs drawn"
import json, re, sys
svg, run, plain = open(sys.argv[1]).read(), json.load(open(sys.argv[2])), open(sys.argv[3]).read()
legend = re.findall(r'<text class="legend"[^>]*>([^<]*)</text>', svg)
assert any("running sequences" in t for t in legend), legend
assert any("--no-sharing" in t for t in legend), legend
series = re.findall(r'<polyline class="series-([a-z-]+)"', svg)
assert sorted(series) == sorted(["held", "cached", "evictable", "running",
                                 "held-no-sharing", "running-no-sharing"]), series
steps = max(run["steps"], run["no_sharing"]["steps"])
x = [float(v) for v in re.findall(r'<text class="tick-x"[^>]*>([^<]*)</text>', svg)]
assert x[-1] >= steps - 1, (x, steps)
assert "(%d steps; --no-sharing: %d)" % (run["steps"], run["no_sharing"]["steps"]) in svg
plain_legend = re.findall(r'<text class="legend"[^>]*>([^<]*)</text>', plain)
assert any("running sequences" in t for t in plain_legend), plain_legend
assert not any("--no-sharing" in t for t in plain_legend), plain_legend
assert "no-sharing" not in "".join(re.findall(r'<polyline class="series-([a-z-]+)"', plain))
print("check_plot: both runs drawn; legend", legend)
PY
echo "check_plot: ok"
