#!/usr/bin/env bash
# repeat.sh TEST N [PRESET]: runs one ctest test N times and counts failures.
#
# TEST is the exact test name (as `ctest -N` lists it, e.g.
# memcheck.stress.concurrent); PRESET is the CMake preset whose build it runs
# in (release, the default, debug or tsan). The build dir is used as it is,
# and built first only when it is missing. Prints one line per failed run,
# with the path of its saved output, then "TEST: F failed of N". Exit status
# 0 when no run failed, 1 when any did, 2 on usage errors.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    echo "usage: scripts/repeat.sh TEST N [PRESET]" >&2
    exit 2
}
[ $# -ge 2 ] && [ $# -le 3 ] || usage
test_name=$1
runs=$2
preset=${3:-release}
case $runs in
    '' | *[!0-9]* | 0) echo "repeat.sh: N must be a positive integer, not '$runs'" >&2; exit 2 ;;
esac
build=build/$preset
if [ ! -f "$build/CTestTestfile.cmake" ]; then
    echo "repeat.sh: $build is missing; building the $preset preset" >&2
    cmake --preset "$preset" >/dev/null
    cmake --build --preset "$preset" >/dev/null
fi

# The name as an exact regular expression: escape every metacharacter.
pattern="^$(printf '%s' "$test_name" | sed 's/[][\.*^$+?(){}|/]/\\&/g')\$"
listed=$(ctest --test-dir "$build" -N -R "$pattern" | sed -n 's/^Total Tests: //p')
if [ "$listed" != 1 ]; then
    echo "repeat.sh: no test named '$test_name' in $build (see ctest --test-dir $build -N)" >&2
    exit 2
fi

logs=$(mktemp -d "${TMPDIR:-/tmp}/kvp-repeat.XXXXXX")
failed=0
for run in $(seq 1 "$runs"); do
    log=$logs/run-$run.log
    if ctest --test-dir "$build" -R "$pattern" --no-tests=error --output-on-failure \
        >"$log" 2>&1; then
        rm -f "$log"
    else
        failed=$((failed + 1))
        # How ctest saw it (Failed, Timeout, ...) and the test's last output line.
        verdict=$(sed -n 's/.*Test *#[0-9]*: .*\*\*\*\([A-Za-z ]*\).*/\1/p' "$log" | head -n 1)
        reason=$(awk '/Test +#[0-9]+: .*\*\*\*/ { on = 1; next }
                      /tests passed, .* failed out of/ { on = 0 }
                      on && NF { last = $0 } END { print last }' "$log")
        verdict=$(printf "%s" "$verdict" | sed "s/ *$//")
        reason="${verdict:-Failed}: ${reason:-no output}"
        echo "run $run of $runs: $reason (output: $log)"
    fi
done
[ "$failed" -ne 0 ] || rmdir "$logs"
echo "$test_name: $failed failed of $runs"
[ "$failed" -eq 0 ]
