#!/bin/sh
# expect_failure.sh EXIT_CODE PATTERN COMMAND...
# Passes only when COMMAND exits with EXIT_CODE and its output contains
# PATTERN: the proof that a checking gate (memcheck, helgrind) really fails
# on the bug planted in COMMAND.
expected=$1
pattern=$2
shift 2
output=$("$@" 2>&1)
code=$?
printf '%s\n' "$output"
if [ "$code" != "$expected" ]; then
    echo "gate check: expected exit code $expected, got $code" >&2
    exit 1
fi
if ! printf '%s\n' "$output" | grep -q -- "$pattern"; then
    echo "gate check: output does not contain '$pattern'" >&2
    exit 1
fi
echo "gate check: the gate failed as it must (exit $code, '$pattern' reported)"
