#!/bin/sh
# check_bench_tier.sh WORKDIR PROGRAM: bench/tier_overhead.c (bench-tier-overhead)
#   --help: exit 0, the usage naming every flag;
#   bad flags and values (unknown, missing, out of range, not a name, an
#   empty or unparsable --redis URL): exit 2, exactly one line on stderr
#   naming the flag and the value, nothing on stdout;
#   a tiny run (2 rounds of a few requests, its own redis-server, warm
#   memory: one pool slab, one full host tier): exit 0, every round and the
#   medians of the three cases printed, the Redis and host tiers wrote blocks
#   (publish), no tier run hit (fresh keys each run), no tier errors or
#   failed writes, and a CPU-per-token line; one round with --memory fresh:
#   the same checks of its output.
set -u
work=$1
prog=$2
rm -rf "$work"
mkdir -p "$work" || exit 1
fail() { echo "check_bench_tier: $*" >&2; exit 1; }
. "$(dirname "$0")/refusal.sh"
rows=0
refuse() {
    name=$1 flag=$2 value=$3
    shift 3
    "$prog" "$@" > "$work/out" 2> "$work/err" < /dev/null
    code=$?
    expect_refusal "$name" "$flag" "$value"
    grep -q "^bench-tier-overhead: " "$work/err" || fail "$name: the line lacks the program's name"
}

"$prog" --help > "$work/out" 2> "$work/err" || fail "--help: exit $?"
for flag in --rounds --requests --budget-mib --host-mib --threads --policy --loads --memory \
    --redis --redis-pid; do
    grep -q -- "^  $flag" "$work/out" || fail "--help lacks $flag"
done

refuse unknown "unknown flag" "'--bogus'" --bogus 1
refuse rounds_zero --rounds "'0'" --rounds 0
refuse rounds_word --rounds "'many'" --rounds=many
refuse rounds_above --rounds "'1001'" --rounds 1001
refuse requests_missing --requests "missing value" --requests
refuse budget_zero --budget-mib "'0'" --budget-mib 0
refuse threads_above --threads "'65'" --threads 65
refuse policy_unknown --policy "'always'" --policy always
refuse loads_unknown --loads "'sometimes'" --loads=sometimes
refuse memory_unknown --memory "'hot'" --memory hot
refuse redis_empty --redis "''" --redis=
refuse redis_scheme --redis "'http://127.0.0.1:6379'" --redis http://127.0.0.1:6379
refuse redis_pid_alone --redis-pid "'123'" --redis-pid 123
refuse redis_pid_zero --redis-pid "'0'" --redis-pid 0 --redis redis://127.0.0.1:1
refuse redis_port --redis "'redis://127.0.0.1:99999'" --redis redis://127.0.0.1:99999

# tiny ROUNDS [FLAGS...]: a run's output, checked
tiny() {
    n=$1
    shift
    "$prog" --rounds "$n" --requests 6 --threads 1 --budget-mib 64 --host-mib 4 "$@" \
        > "$work/out" 2> "$work/err" < /dev/null || fail "a tiny run ($*): exit $?: $(cat "$work/err")"
    [ ! -s "$work/err" ] || fail "a tiny run ($*) wrote on stderr: $(cat "$work/err")"
    for r in $(seq "$n"); do
        grep -q "^round $r: none [0-9.]*, host [0-9.]* (.*x), redis [0-9.]* (.*x) tokens/s" \
            "$work/out" || fail "round $r missing: $(cat "$work/out")"
    done
    grep -q "^medians of $n rounds (6 requests, [1-9][0-9]* generated tokens a run, 1 decoder" \
        "$work/out" || fail "no medians line: $(cat "$work/out")"
    # case, tokens/s, ratio, wall, cpu, thread, server, writes, hits
    awk '$1 == "none" && $9 == 0 && $8 == 0 && $3 == "1.000x" { ok = 1 } END { exit !ok }' \
        "$work/out" || fail "none's row: $(grep '^none' "$work/out")"
    for k in host redis; do
        awk -v k=$k '$1 == k && $8 > 0 && $9 == 0 && $2 > 0 { ok = 1 } END { exit !ok }' \
            "$work/out" || fail "$k's row (writes > 0, hits 0): $(grep "^$k" "$work/out")"
    done
    # The private server's CPU is measured (a number; it may round to 0 ticks in so short a run).
    awk '$1 == "redis" && $7 ~ /^[0-9]+\.[0-9]$/ { ok = 1 } END { exit !ok }' "$work/out" ||
        fail "no redis-server CPU column: $(grep '^redis' "$work/out")"
    grep -q '^tier runs: 0 hit blocks, 0 errors, 0 failed writes' "$work/out" ||
        fail "tier hits, errors or failed writes: $(grep '^tier runs' "$work/out")"
}
tiny 1 --memory fresh
grep -q '^tier overhead: .*, memory fresh;' "$work/out" || fail "fresh memory not said"
tiny 2
grep -q '^tier overhead: .*, memory warm;' "$work/out" || fail "warm memory not said"
grep -q '^redis tier CPU per token: ' "$work/out" || fail "no CPU-per-token line"
echo "check_bench_tier: $rows bad inputs refused; a tiny run printed every figure"
