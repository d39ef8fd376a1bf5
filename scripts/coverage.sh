#!/usr/bin/env bash
# coverage.sh: line and branch coverage of src/, per folder, against targets.
# Installs missing Debian packages (gcovr too: only this script needs it),
# builds the `coverage` preset (gcc --coverage -fprofile-update=atomic; without
# the atomic flag the threaded tests give negative counts that gcovr rejects),
# runs every test in it, and prints gcovr's summary per folder.
#
# Usage: scripts/coverage.sh [--html DIR]
# Exit status: 0 when every folder meets its target, 1 otherwise.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
kvp_packages="$kvp_packages gcovr"
kvp_install_deps

html=""
if [ "${1:-}" = "--html" ]; then
    html=${2:?--html needs a directory}
elif [ $# -gt 0 ]; then
    echo "usage: scripts/coverage.sh [--html DIR]" >&2
    exit 2
fi

build=build/coverage
# From scratch: objects of renamed or removed targets would leave notes files
# that gcov can no longer match to their sources.
rm -rf "$build"
cmake --preset coverage >/dev/null
cmake --build --preset coverage >/dev/null
ctest --preset coverage >"$build/ctest.log" 2>&1 || {
    tail -n 30 "$build/ctest.log" >&2
    echo "coverage: some tests failed (full log: $build/ctest.log)" >&2
    exit 1
}

# folder  line%  branch%  (the targets)
targets="src/pager 97 95
src/attention 97 95
src/serve 97 95
src/cli 90 80"

gcovr_common=(-r . "$build" --exclude-unreachable-branches --exclude-throw-branches)
status=0
printf '%-14s %8s %8s   %s\n' folder lines branches "target (lines, branches)"
while read -r folder line_target branch_target; do
    summary=$(gcovr "${gcovr_common[@]}" --filter "$folder/" --json-summary)
    read -r lines branches < <(python3 -c '
import json, sys
s = json.load(sys.stdin)
print(s["line_percent"], s["branch_percent"])' <<<"$summary")
    verdict=met
    if python3 -c "import sys; sys.exit(0 if $lines >= $line_target and $branches >= $branch_target else 1)"; then
        :
    else
        verdict="NOT MET"
        status=1
    fi
    printf '%-14s %7.1f%% %7.1f%%   >= %s%%, >= %s%%: %s\n' "$folder" "$lines" "$branches" \
        "$line_target" "$branch_target" "$verdict"
done <<<"$targets"

echo
echo "per file (src/):"
gcovr "${gcovr_common[@]}" --filter src/ --txt --sort-percentage | sed -n '/^File/,$p'
if [ -n "$html" ]; then
    mkdir -p "$html"
    gcovr "${gcovr_common[@]}" --filter src/ --html-details "$html/index.html"
    echo "HTML report: $html/index.html"
fi
exit $status
