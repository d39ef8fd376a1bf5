#!/bin/sh
# check_demo.sh MODE EXPECTED COMMAND...
# Checks `kvpager demo`. COMMAND is the kvpager program, possibly behind a
# wrapper such as Valgrind memcheck (whose error exit code then fails the
# check).
#   trace  `COMMAND demo` exits 0 and its first six lines equal EXPECTED (the
#          seed chapter's report) byte for byte.
#   json   `COMMAND demo --json` exits 0 and prints one valid JSON object with
#          "ok": true, whose three step outputs, printed as the trace prints
#          them, are the ones in EXPECTED.
set -u
mode=$1
expected=$2
shift 2
fail() { echo "check_demo: $*" >&2; exit 1; }

out=$(mktemp) || fail "cannot make a temporary file"
head6=$(mktemp) || fail "cannot make a temporary file"
trap 'rm -f "$out" "$head6"' EXIT

case $mode in
trace) "$@" demo > "$out" ;;
json) "$@" demo --json > "$out" ;;
*) fail "unknown mode '$mode' (trace or json)" ;;
esac
code=$?
cat "$out"
[ "$code" -eq 0 ] || fail "exit status $code, expected 0"

if [ "$mode" = trace ]; then
    head -n 6 "$out" > "$head6"
    if ! cmp -s "$head6" "$expected"; then
        diff "$expected" "$head6" >&2
        fail "the first six lines differ from $expected"
    fi
    echo "check_demo: trace ok"
    exit 0
fi

python3 - "$out" "$expected" <<'PY' || fail "JSON evidence does not hold"
import json, re, sys
with open(sys.argv[1]) as f:
    evidence = json.load(f)
if not isinstance(evidence, dict):
    sys.exit("the output is not a JSON object")
if evidence.get("ok") is not True:
    sys.exit('"ok" is not true')
with open(sys.argv[2]) as f:
    lines = [line for line in f.read().splitlines() if line.startswith("step=")]
steps = evidence.get("steps")
if not isinstance(steps, list) or len(steps) != len(lines):
    sys.exit("expected %d steps" % len(lines))
for step, line in zip(steps, lines):
    printed = "[" + ",".join("%.9f" % v for v in step["output"]) + "]"
    wanted = re.search(r"output:(\[.*\])", line).group(1)
    if printed != wanted:
        sys.exit("step %d output %s, expected %s" % (step["position"], printed, wanted))
PY
echo "check_demo: json ok"
