# refusal.sh: sourced by the CLI checks that feed a command bad input.
#
# expect_refusal NAME FLAG VALUE: judges the run that just wrote $work/out and
# $work/err and exited with $code. A refusal exits 2 with exactly one line on
# stderr naming both FLAG and VALUE, prints nothing on stdout, and runs too
# little to create $work/ran.svg. Needs $work and a fail function; counts
# each call in $rows.
expect_refusal() {
    name=$1 flag=$2 value=$3
    rows=$((rows + 1))
    [ "$code" = 2 ] || fail "$name: exit $code, expected 2: $(cat "$work/err")"
    lines=$(wc -l < "$work/err")
    [ "$lines" = 1 ] || fail "$name: $lines lines on stderr, expected 1: $(cat "$work/err")"
    grep -qF -- "$flag" "$work/err" || fail "$name: '$flag' not named in: $(cat "$work/err")"
    grep -qF -- "$value" "$work/err" || fail "$name: '$value' not named in: $(cat "$work/err")"
    [ ! -s "$work/out" ] || fail "$name: it ran and printed: $(head -c 200 "$work/out")"
    [ ! -e "$work/ran.svg" ] || fail "$name: it ran far enough to create the plot"
}
