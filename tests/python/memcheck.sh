#!/usr/bin/env bash
# memcheck.sh VALGRIND PYTHON SUPPRESSIONS LOG PYTEST_ARGS...: one pytest run of
# the Python module under Valgrind memcheck (ctest's memcheck.python.pytest).
# Fails (exit 97) on any memcheck error (invalid read or write, use of
# uninitialised memory, bad free) anywhere, and on any definitely or
# indirectly lost block allocated under the module or libkvpager (_kvpager,
# libkvpager, kvp_ in the loss record's stack). The interpreter's and
# NumPy's own blocks still allocated at exit (Python frees not all at
# exit, even with PYTHONMALLOC=malloc and Debian's python3.supp) are
# reported in LOG but not counted. ld.supp (beside this script) holds the
# loader's one false positive.
set -u
valgrind=$1 python=$2 supp=$3 log=$4
shift 4
"$valgrind" --tool=memcheck --error-exitcode=97 --errors-for-leak-kinds=none \
    --leak-check=full --show-leak-kinds=definite,indirect --num-callers=40 \
    --suppressions="$supp" --suppressions="$(dirname "$0")/ld.supp" --log-file="$log" "$python" -m pytest -q -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -ne 0 ]; then
    echo "memcheck.sh: exit $rc (97: a memcheck error; see $log)"
    grep -E "Invalid|uninitialised|Conditional jump|Mismatched free" "$log" | head -20
    exit "$rc"
fi
ours=$(awk '/lost in loss record/ {rec = $0; keep = 0; next}
            rec != "" && /_kvpager|libkvpager|kvp_/ {keep = 1}
            rec != "" && /^==[0-9]+== $/ {if (keep) print rec; rec = ""}' "$log")
if [ -n "$ours" ]; then
    echo "memcheck.sh: blocks lost under the module or libkvpager (see $log):"
    echo "$ours"
    exit 97
fi
echo "memcheck.sh: no memcheck error; no block lost under _kvpager or libkvpager" \
     "($(grep -c 'lost in loss record' "$log") interpreter/NumPy records at exit, not counted)"
