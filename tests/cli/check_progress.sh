#!/bin/sh
# check_progress.sh WORKDIR SCRIPT KVPAGER
# The progress line of `kvpager simulate` appears only when stderr is a
# terminal. Under script(1), which gives the program a pseudo-terminal, a run
# must draw "simulate [====...] done/total requests (step N)" lines and clear
# the line at the end; with --quiet, or with stderr not a terminal, nothing.
set -eu
work=$1
script=$2
kvpager=$3
mkdir -p "$work"
fail() { echo "check_progress: $*" >&2; exit 1; }
run="simulate --requests 6 --prompt-mean 8 --output-mean 8 --capacity 64 --budget 64KiB --no-compute"

"$script" -qec "'$kvpager' $run > /dev/null" /dev/null > "$work/tty.txt" < /dev/null \
    || fail "the run under a terminal failed"
grep -q "simulate \[=* *\] [0-9]*/6 requests (step [0-9]*)" "$work/tty.txt" \
    || fail "no progress line on a terminal: $(od -c "$work/tty.txt" | head)"
grep -q "simulate \[==============================\] 6/6 requests" "$work/tty.txt" \
    || fail "the progress line never showed the finished run"
printf '\033[K' > "$work/clear"
grep -qF "$(cat "$work/clear")" "$work/tty.txt" || fail "the progress line was not cleared"

"$script" -qec "'$kvpager' $run --quiet > /dev/null" /dev/null > "$work/quiet.txt" < /dev/null \
    || fail "the quiet run under a terminal failed"
! grep -q "requests (step" "$work/quiet.txt" || fail "--quiet still drew progress"

"$kvpager" $run > /dev/null 2> "$work/pipe.txt" || fail "the run failed"
[ ! -s "$work/pipe.txt" ] || fail "progress drawn on a non-terminal: $(cat "$work/pipe.txt")"
echo "check_progress: ok"
