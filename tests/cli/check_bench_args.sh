#!/bin/sh
# check_bench_args.sh WORKDIR BINDIR: the flags of the bench/ programs
# (bench/args.h), each program in BINDIR run with
#   --help and -h: exit 0, the usage on stdout naming every flag, no stderr;
#   an unknown flag, a stray argument, a missing value, bad values (not a
#   number, out of range, too big for 64 bits, not one of the names, a value
#   on a switch) and values a check between flags refuses: exit 2, exactly
#   one line on stderr naming the flag and the value, nothing on stdout;
#   --flag=value: a tiny run that must succeed (exit 0).
set -u
work=$1
bin=$2
rm -rf "$work"
mkdir -p "$work" || exit 1
fail() { echo "check_bench_args: $*" >&2; exit 1; }
. "$(dirname "$0")/refusal.sh"

rows=0
# refuse NAME FLAG VALUE PROGRAM ARGS...: FLAG and VALUE must both appear in the one line.
refuse() {
    name=$1 flag=$2 value=$3 prog=$4
    shift 4
    "$bin/$prog" "$@" > "$work/out" 2> "$work/err" < /dev/null
    code=$?
    expect_refusal "$prog $name" "$flag" "$value"
    grep -q "^$prog: " "$work/err" || fail "$prog $name: the line does not start with '$prog: '"
}

# help PROGRAM FLAG...: --help and -h print a usage naming every FLAG, exit 0.
help() {
    prog=$1
    shift
    for h in --help -h; do
        # The usage wins over every other argument, good or bad.
        "$bin/$prog" --bogus "$h" > "$work/out" 2> "$work/err" < /dev/null
        code=$?
        [ "$code" = 0 ] || fail "$prog $h: exit $code: $(cat "$work/err")"
        [ ! -s "$work/err" ] || fail "$prog $h: wrote on stderr: $(cat "$work/err")"
        head -n 1 "$work/out" | grep -q "^usage: $prog " || fail "$prog $h: no usage line"
        for flag in "$@" --help; do
            grep -q -- "^  $flag" "$work/out" || fail "$prog $h: the usage lacks $flag"
        done
    done
    code=0
    "$bin/$prog" --help > /dev/full 2> "$work/err" || code=$?
    if [ "$code" != 2 ] || [ "$(wc -l < "$work/err")" != 1 ]; then
        fail "$prog --help > /dev/full: exit $code: $(cat "$work/err")"
    fi
}

# common PROGRAM: the cases every program shares (all have --repetitions).
common() {
    prog=$1
    refuse unknown_flag "unknown flag" "'--bogus'" "$prog" --bogus 1
    refuse unknown_equals "unknown flag" "'--repetition=3'" "$prog" --repetition=3
    refuse stray "unexpected argument" "'foo'" "$prog" foo
    refuse missing --repetitions "missing value" "$prog" --repetitions
    refuse word --repetitions "'abc'" "$prog" --repetitions abc
    refuse zero --repetitions "'0'" "$prog" --repetitions 0
    refuse equals_zero --repetitions "'0'" "$prog" --repetitions=0
    refuse equals_empty --repetitions "''" "$prog" --repetitions=
    refuse negative --repetitions "'-1'" "$prog" --repetitions -1
    refuse fraction --repetitions "'1.5'" "$prog" --repetitions 1.5
    refuse space --repetitions "' 3'" "$prog" --repetitions " 3"
    refuse overflow --repetitions "'18446744073709551616'" "$prog" \
        --repetitions 18446744073709551616
    refuse huge --repetitions "'18446744073709551615'" "$prog" --repetitions 18446744073709551615
    refuse hex --repetitions "'0x10'" "$prog" --repetitions 0x10
    refuse last_bad --repetitions "'x'" "$prog" --repetitions 1 --repetitions x
}

# runs PROGRAM ARGS...: a tiny run with --flag=value must succeed.
runs() {
    prog=$1
    shift
    "$bin/$prog" "$@" > "$work/out" 2> "$work/err" < /dev/null ||
        fail "$prog $*: exit $?: $(cat "$work/err")"
    [ -s "$work/out" ] || fail "$prog $*: printed nothing"
}

p=bench-gather
help $p --len --heads --head-width --block --repetitions --min-ns --isa --sequential --json
common $p
refuse isa_unknown --isa "'avx1024'" $p --isa avx1024
refuse isa_case --isa "'AVX2'" $p --isa=AVX2
refuse switch_value --json "'yes'" $p --json=yes
refuse len_zero --len "'0'" $p --len 0
refuse len_above --len "'16777217'" $p --len=16777217
refuse min_ns_exponent --min-ns "'2e6'" $p --min-ns 2e6
runs $p --len=64 --heads=2 --head-width=16 --block=16 --repetitions=1 --min-ns=1 --isa=scalar \
    --sequential --json
grep -q '"block_tokens":16' "$work/out" || fail "$p: --block=16 was not used"
grep -q '"isa":"avx2"' "$work/out" && fail "$p: --isa=scalar ran avx2"

p=bench-softmax
help $p --repetitions --min-ns
common $p
refuse min_ns_nan --min-ns "'nan'" $p --min-ns nan
refuse min_ns_inf --min-ns "'inf'" $p --min-ns=inf
refuse min_ns_negative --min-ns "'-1'" $p --min-ns -1
refuse min_ns_above --min-ns "'1e13'" $p --min-ns 1e13
refuse min_ns_word --min-ns "'e'" $p --min-ns e
runs $p --repetitions=1 --min-ns=1

p=bench-split
help $p --len --heads --kv-heads --head-width --block --threads --dtype --repetitions --min-ns \
    --value-units --chunk-kib
common $p
refuse dtype_unknown --dtype "'f16'" $p --dtype f16
refuse dtype_empty --dtype "''" $p --dtype=
refuse threads_one --threads "'1'" $p --threads 1
refuse kv_heads_not_dividing --kv-heads "'3'" $p --kv-heads 3
refuse kv_heads_equals --kv-heads "'3'" $p --heads=8 --kv-heads=3
refuse head_width_odd --head-width "'33'" $p --head-width 33
refuse value_units_zero --value-units "'0'" $p --value-units 0
runs $p --len=512 --heads=4 --kv-heads=2 --head-width=16 --block=16 --threads=2 --dtype=f32 \
    --repetitions=1 --min-ns=1
grep -q '^f32 ' "$work/out" || fail "$p: --dtype=f32 did not run f32"
grep -q '^f64 ' "$work/out" && fail "$p: --dtype=f32 also ran f64"

p=bench-projection
help $p --quick --repetitions --min-ns --max-madds
common $p
refuse switch_value --quick "'1'" $p --quick=1
refuse max_madds_overflow --max-madds "'18446744073709551616'" $p --max-madds 18446744073709551616
refuse min_ns_word --min-ns "'fast'" $p --min-ns=fast
runs $p --quick --repetitions=1 --min-ns=1 --max-madds=4096
grep -q '^ *64 *64 *[0-9]' "$work/out" && fail "$p: --max-madds=4096 ran 64 x 64 x 64"

p=bench-prefill
help $p --len --tokens --layers --width --heads --kv-heads --block --repetitions --min-ns
common $p
refuse tokens_one --tokens "'1'" $p --tokens 1
refuse heads_not_dividing --heads "'3'" $p --heads 3
refuse head_width_odd --heads "'4'" $p --width 20 --heads 4 --kv-heads 4
refuse kv_heads_not_dividing --kv-heads "'3'" $p --kv-heads=3
refuse block_zero --block "'0'" $p --block 0
runs $p --len=40 --tokens=20 --layers=2 --width=32 --heads=4 --kv-heads=2 --block=8 \
    --repetitions=1 --min-ns=1

p=bench-model
help $p --layers --width --heads --positions --repetitions
common $p
refuse repetitions_above --repetitions "'65'" $p --repetitions 65
refuse layers_word --layers "'abc'" $p --layers abc
refuse width_empty --width "''" $p --width=
refuse heads_not_dividing --heads "'3'" $p --heads 3
refuse positions_zero --positions "'0'" $p --positions=0
runs $p --layers=2 --width=16 --heads=2 --positions=64 --repetitions=1
grep -q 'layers=2 width=16 heads=2 positions=64' "$work/out" || fail "$p: the flags were not used"

p=bench-keys
help $p --repetitions --min-ns
common $p
refuse min_ns_above --min-ns "'1e13'" $p --min-ns 1e13
refuse min_ns_hex --min-ns "'0x10'" $p --min-ns=0x10
runs $p --repetitions=1 --min-ns=1

p=bench-decode
help $p --dtype --heads --kv-heads --head-width --block --len --repetitions --min-ns --phases --only
common $p
refuse dtype_unknown --dtype "'fp16'" $p --dtype fp16
refuse only_unknown --only "'fast2'" $p --only=fast2
refuse kv_heads_not_dividing --kv-heads "'3'" $p --kv-heads 3
refuse head_width_odd --head-width "'33'" $p --head-width 33
refuse phases_value --phases "'1'" $p --phases=1
runs $p --dtype=fp8 --len=64 --heads=4 --kv-heads=2 --head-width=32 --block=16 \
    --repetitions=1 --min-ns=1 --only=fast

echo "check_bench_args: $rows bad inputs refused with exit 2 and one line;" \
    "--help and --flag=value ok"
