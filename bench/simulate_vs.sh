#!/usr/bin/env bash
# simulate_vs.sh REF [RUNS]: `kvpager simulate` (the default workload) of
# this checkout against a build of the older commit REF, side by side in one run.
#
# REF is required: the build to compare against (a commit, tag or branch of
# this repository). A speed-up is reported as a multiple of REF's tokens/s
# measured in the same run on the same machine, since this machine is shared
# and its speed moves.
#
# The script builds REF's release `kvpager` in a temporary worktree (no
# network: REF must be in this repository), builds this checkout's, then runs
# the two programs alternately RUNS times (default 7) and prints each run's
# tokens/s, the medians and their ratio, the median of the pairs' own
# ratios (robust when the machine's load drifts), and both builds' output checksums
# (the workload is the same; the checksums differ only where the arithmetic
# changed between the commits, e.g. the softmax's exp). Extra simulate flags go in
# SIMULATE_FLAGS (e.g. SIMULATE_FLAGS="--threads 1").
# Not part of the test command: it reports a speed, it asserts none.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: simulate_vs.sh REF [RUNS] (REF: the older commit to compare against)" >&2
    exit 2
fi
ref=$1
runs=${2:-7}
flags=${SIMULATE_FLAGS:-}
git rev-parse --verify --quiet "$ref^{commit}" >/dev/null ||
    { echo "simulate_vs.sh: unknown commit '$ref'" >&2; exit 2; }
case $runs in '' | *[!0-9]* | 0) echo "simulate_vs.sh: RUNS must be a positive whole number, got '$runs'" >&2; exit 2 ;; esac
work=$(mktemp -d)
trap 'git worktree remove --force "$work/old" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
git worktree add --quiet --detach "$work/old" "$ref"
echo "building $ref and this checkout (release)" >&2
cmake -S "$work/old" -B "$work/old-build" -DCMAKE_BUILD_TYPE=Release -DKVP_BUILD_TESTS=OFF \
    >/dev/null
cmake --build "$work/old-build" --target kvpager-cli -j2 >/dev/null
cmake --preset release >/dev/null
cmake --build --preset release --target kvpager-cli >/dev/null
old="$work/old-build/kvpager"
new=./build/release/kvpager

run() { # prints "tokens_per_second output_checksum"
    # shellcheck disable=SC2086
    "$1" simulate --quiet --json $flags | python3 -c \
        'import json,sys; r=json.load(sys.stdin); print(r["tokens_per_second"], r["output_checksum"])'
}
python3 - "$runs" "$ref" <<'PY' 3< <(for _ in $(seq "$runs"); do run "$old"; run "$new"; done)
import os, statistics, sys
runs, ref = int(sys.argv[1]), sys.argv[2]
lines = [line.split() for line in os.fdopen(3)]
old = [float(l[0]) for l in lines[0::2]]
new = [float(l[0]) for l in lines[1::2]]
for i, (a, b) in enumerate(zip(old, new)):
    print("run %d: %s %.0f tokens/s, this checkout %.0f tokens/s" % (i + 1, ref, a, b))
mo, mn = statistics.median(old), statistics.median(new)
ratios = [b / a for a, b in zip(old, new)]
print("median: %s %.0f tokens/s, this checkout %.0f tokens/s: %.2fx; median of the runs' "
      "own ratios (each pair run back to back): %.2fx" % (ref, mo, mn, mn / mo,
                                                         statistics.median(ratios)))
co, cn = {l[1] for l in lines[0::2]}, {l[1] for l in lines[1::2]}
print("output checksum: %s %s, this checkout %s%s" % (
    ref, " ".join(sorted(co)), " ".join(sorted(cn)), " (equal)" if co == cn else ""))
PY
