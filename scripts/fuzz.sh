#!/usr/bin/env bash
# fuzz.sh SECONDS [SEED]: a long run of the kvpager fuzz target (tests/fuzz/).
# Installs missing Debian packages (clang and its libFuzzer runtime among
# them), builds the `fuzz` preset, and fuzzes for SECONDS on one worker from
# a working corpus in build/fuzz/long/corpus (seeded from tests/fuzz/corpus
# and tests/fuzz/regressions, and kept between runs; the committed corpus is
# never modified). Any crash input is copied to tests/fuzz/regressions/,
# where the test command replays it; commit it with the fix.
#
# The run is cut into chunks of KVP_FUZZ_CHUNK seconds (default 120), each a
# fresh process with the next seed and at most 250000 executions, which
# keeps one process's memory bounded (ASan's quarantine and the in-memory
# corpus grow with executions: about 450 MB after 120 000). Prints the clean
# executions and the coverage (libFuzzer's cov/ft) at the end.
# KVP_FUZZ_TARGET=scheduler runs the scheduler's target instead
# (tests/fuzz/fuzz_scheduler.c: tests/fuzz/scheduler/{corpus,regressions},
# work in build/fuzz/long-scheduler).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || ! [ "$1" -gt 0 ] 2>/dev/null; then
    echo "usage: scripts/fuzz.sh SECONDS [SEED]" >&2
    exit 2
fi
case "${KVP_FUZZ_TARGET:-api}" in
api) name=kvp_fuzz_api dir=tests/fuzz work=build/fuzz/long ;;
scheduler) name=kvp_fuzz_scheduler dir=tests/fuzz/scheduler work=build/fuzz/long-scheduler ;;
*)
    echo "scripts/fuzz.sh: KVP_FUZZ_TARGET: '$KVP_FUZZ_TARGET' is not api or scheduler" >&2
    exit 2
    ;;
esac
total=$1
seed=${2:-1}
chunk=${KVP_FUZZ_CHUNK:-120}
. scripts/deps.sh
kvp_install_deps
cmake --preset fuzz >/dev/null
cmake --build --preset fuzz >/dev/null
mkdir -p "$work/corpus" "$work/crashes"
# The binary is copied so that rebuilding during a long run changes nothing.
cp "build/fuzz/tests/fuzz/$name" "$work/$name"
for from in "$dir/corpus" "$dir/regressions"; do
    find "$from" -maxdepth 1 -type f ! -name 'README*' -exec cp {} "$work/corpus/" \;
done
executions=0
elapsed=0
round=0
status=0
while [ "$elapsed" -lt "$total" ]; do
    left=$((total - elapsed))
    this=$((left < chunk ? left : chunk))
    log="$work/round-$round.log"
    started=$(date +%s)
    "$work/$name" -seed=$((seed + round)) -max_total_time="$this" -runs=250000 \
        -max_len=1024 -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 \
        -artifact_prefix="$work/crashes/" "$work/corpus" >"$log" 2>&1 || status=$?
    elapsed=$((elapsed + $(date +%s) - started))
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    coverage=$(grep -Eo 'cov: [0-9]+ ft: [0-9]+' "$log" | tail -1)
    if [ "$status" -ne 0 ]; then
        echo "round $round (seed $((seed + round))): the target FAILED (exit $status); see $log" >&2
        grep -E 'MISMATCH|ERROR|SUMMARY' "$log" | head -5 >&2 || true
        break
    fi
    executions=$((executions + ${runs:-0}))
    echo "round $round (seed $((seed + round)), ${this}s): ${runs:-0} clean executions, $coverage"
    round=$((round + 1))
done
found=0
for crash in "$work"/crashes/*; do
    [ -f "$crash" ] || continue
    cp "$crash" "$dir/regressions/"
    echo "new regression case: $dir/regressions/$(basename "$crash")"
    found=$((found + 1))
done
echo "kvpager fuzz: $executions clean executions in ${elapsed}s, $coverage," \
     "corpus $(find "$work/corpus" -type f | wc -l) inputs, $found crash inputs"
exit "$status"
