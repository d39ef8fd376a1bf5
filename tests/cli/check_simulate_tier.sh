#!/bin/sh
# check_simulate_tier.sh WORKDIR COMMAND...
# `kvpager simulate`'s second-tier flags (src/cli/simulate_tier.c): every bad
# value or combination is refused before anything runs (exit 2, one line
# naming the flag and the value: refusal.sh), a Redis URL's password is
# never echoed, `--flag v` and `--flag=v` read alike, and a host-tier run
# reports the tier and its --json "tier" keys (null without --tier); an
# allocator-only run (--no-compute) takes one keys-only host tier (Redis and
# two tiers refused) and loads what it evicted.
set -u
work=$1
shift
rm -rf "$work"
mkdir -p "$work" || exit 1
fail() { echo "check_simulate_tier: $*" >&2; exit 1; }
. "$(dirname "$0")/refusal.sh"

printf 'a deployment secret of at least 16 bytes\n' > "$work/secret"
printf 'short\n' > "$work/short"
rows=0
run() {
    name=$1 flag=$2 value=$3
    shift 3
    rm -f "$work/ran.svg"
    "$@" --plot "$work/ran.svg" > "$work/out" 2> "$work/err" < /dev/null
    code=$?
    expect_refusal "$name" "$flag" "$value"
}
S="$* simulate --quiet"
run host_zero --tier "'host:0'" $S --tier host:0
run host_no_size --tier "'host:'" $S --tier host:
run not_a_tier --tier "'disk:1GiB'" $S --tier disk:1GiB
run equals_form --tier "'nope'" $S --tier=nope
run needs_value --tier "needs a value" $S --tier
run empty_equals --tier "needs a value" $S --tier=
run five_tiers --tier "at most 4" $S --tier host:1MiB --tier host:1MiB --tier host:1MiB \
    --tier host:1MiB --tier host:1MiB
run bad_port --tier "port" $S --tier redis://127.0.0.1:99999 --tier-secret-file "$work/secret"
run bad_scheme --tier "'rediss://h'" $S --tier rediss://h
run bad_password --tier "'redis://u:***@h'" $S --tier 'redis://u:p%zz@h' \
    --tier-secret-file "$work/secret"
grep -q 'p%zz' "$work/err" && fail "bad_password: the password was echoed: $(cat "$work/err")"
run redis_needs_secret --tier-secret-file "redis://127.0.0.1:1" $S --tier redis://127.0.0.1:1
run no_compute_redis --no-compute "redis://127.0.0.1:1" $S --tier redis://127.0.0.1:1 \
    --tier-secret-file "$work/secret" --no-compute
run no_compute_two --no-compute "host:1MiB" $S --tier host:1MiB --tier host:2MiB --no-compute
run no_sharing --no-sharing "host:1MiB" $S --tier host:1MiB --no-sharing
run policy_without_tier --tier-policy "publish" $S --tier-policy publish
run loads_without_tier --tier-loads "always" $S --tier-loads=always
run secret_without_tier --tier-secret-file "$work/secret" $S --tier-secret-file "$work/secret"
run bad_policy --tier-policy "'both'" $S --tier host:1MiB --tier-policy both
run bad_loads --tier-loads "'sometimes'" $S --tier host:1MiB --tier-loads sometimes
run policy_twice --tier-policy "'evict'" $S --tier host:1MiB --tier-policy publish \
    --tier-policy evict
run secret_missing --tier-secret-file "'$work/none'" $S --tier host:1MiB \
    --tier-secret-file "$work/none"
run secret_short --tier-secret-file "16 to 4096" $S --tier host:1MiB \
    --tier-secret-file "$work/short"
R="--tier redis://127.0.0.1:1 --tier-secret-file $work/secret"
# shellcheck disable=SC2086
run timeout_zero --tier-timeout-ms "'0'" $S $R --tier-timeout-ms 0
# shellcheck disable=SC2086
run timeout_big --tier-timeout-ms "'600001'" $S $R --tier-timeout-ms=600001
# shellcheck disable=SC2086
run timeout_word --tier-timeout-ms "'1s'" $S $R --tier-timeout-ms 1s
# shellcheck disable=SC2086
run retry_negative --tier-retry-ms "'-1'" $S $R --tier-retry-ms=-1
# shellcheck disable=SC2086
run retry_big --tier-retry-ms "'30001'" $S $R --tier-retry-ms 30001
# shellcheck disable=SC2086
run retry_twice --tier-retry-ms "'5'" $S $R --tier-retry-ms 0 --tier-retry-ms 5
run retry_needs_value --tier-retry-ms "needs a value" $S --tier-retry-ms=
run timeout_without_tier --tier-timeout-ms "500" $S --tier-timeout-ms 500
run retry_host_only --tier-retry-ms "0" $S --tier host:1MiB --tier-retry-ms 0
run timeout_host_only --tier-timeout-ms "500" $S --tier host:1MiB --tier-timeout-ms=500

# Accepted: both spellings, a host tier's report lines and --json keys.
small="--requests 4 --layers 1 --model-width 32 --heads 2 --block-tokens 8 --prompt-mean 48 --output-mean 4 --capacity 128"
# shellcheck disable=SC2086
"$@" simulate --quiet $small --tier=host:1MiB --tier-policy=publish --tier-loads always \
    > "$work/report" 2> "$work/err" || fail "host run: $(cat "$work/err")"
grep -q '^tier  *host:1MiB, write-through (publish)' "$work/report" ||
    fail "no tier line: $(cat "$work/report")"
grep -q '^tier loads ' "$work/report" || fail "no tier loads line"
grep -q '^tier prefetches  *[0-9]* issued' "$work/report" || fail "no tier prefetches line"
# shellcheck disable=SC2086
"$@" simulate --quiet $small --tier host:1MiB --tier-secret-file "$work/secret" --json \
    > "$work/json" 2> "$work/err" || fail "host --json run: $(cat "$work/err")"
for key in hit_blocks hit_tokens load_bytes load_seconds writes write_failures rejected errors \
           bytes_per_second prefill_tokens_per_second \
           recomputes prefetches prefetch_used prefetch_late prefetch_wasted; do
    grep -q "\"tier\":{.*\"$key\":" "$work/json" || fail "--json lacks tier.$key"
done
# shellcheck disable=SC2086
"$@" simulate --quiet $small --json > "$work/none.json" 2> "$work/err" || fail "plain run"
grep -q '"tier":null' "$work/none.json" || fail "--json without --tier: tier is not null"

# Allocator-only with a keys-only host tier: conversation turns at a 32 MiB
# pool, without and with a 256 MiB tier. The tier's loads are prefix hits
# the pool alone missed; every figure is consistent across the report.
conv="--profile conversation --budget 32MiB --no-compute --json"
# shellcheck disable=SC2086
"$@" simulate --quiet $conv > "$work/alloc.json" 2> "$work/err" || fail "alloc run: $(cat "$work/err")"
# shellcheck disable=SC2086
"$@" simulate --quiet $conv --tier host:256MiB > "$work/keys.json" 2> "$work/err" ||
    fail "keys-only run: $(cat "$work/err")"
python3 - "$work/alloc.json" "$work/keys.json" <<'PY' || fail "keys-only figures"
import json, sys
alone = json.load(open(sys.argv[1]))
keys = json.load(open(sys.argv[2]))
assert alone["tier"] is None, alone["tier"]
t = keys["tier"]
assert t["keys_only"] == 1, t
assert t["hit_blocks"] > 0 and t["hit_tokens"] == 16 * t["hit_blocks"], t
assert t["writes"] > 0 and t["write_failures"] == 0, t
assert t["rejected"] == 0 and t["errors"] == 0 and t["recomputes"] == 0, t
assert t["bytes_per_second"] == 0 and t["prefill_tokens_per_second"] == 0, t
assert t["load_bytes"] % t["hit_blocks"] == 0, t  # every block at its size
# The pool's own hits are the same workload's; the tier adds its loads on top.
gain = keys["prefix_hit_tokens"] - alone["prefix_hit_tokens"]
assert gain > 0 and gain <= t["hit_tokens"], (gain, t)
assert keys["prefix_hit_rate"] > alone["prefix_hit_rate"] + 0.05, (keys["prefix_hit_rate"], alone["prefix_hit_rate"])
print("keys-only tier: prefix hit rate %.1f%% -> %.1f%%, %d blocks loaded" % (
    100 * alone["prefix_hit_rate"], 100 * keys["prefix_hit_rate"], t["hit_blocks"]))
PY
# shellcheck disable=SC2086
"$@" simulate --quiet --profile conversation --budget 32MiB --no-compute --tier host:256MiB \
    > "$work/keys.txt" 2> "$work/err" || fail "keys-only report run"
grep -q '^tier  *host:256MiB, keys only' "$work/keys.txt" || fail "no keys-only line: $(cat "$work/keys.txt")"

# The Mooncake trace, allocator-only on a small geometry (128 B a token): a
# 32 MiB pool and a keys-only 256 MiB tier against an LRU of both sizes'
# blocks (the pool+tier LRU line): the issue's >= 90% of it.
trace="$(dirname "$0")/../../data/traces/mooncake_synthetic_trace.jsonl"
"$@" simulate --quiet --trace "$trace" --trace-format mooncake --layers 1 --model-width 8 \
    --heads 1 --block-tokens 512 --no-compute --budget 32MiB --tier host:256MiB --json \
    > "$work/trace.json" 2> "$work/err" || fail "trace run: $(cat "$work/err")"
python3 - "$work/trace.json" <<'PY' || fail "trace figures"
import json, sys
r = json.load(open(sys.argv[1]))
assert r["trace_lru_blocks"] == 512 and r["trace_tier_lru_blocks"] == 512 + 4096, r
assert r["trace_tier_lru_hit_rate"] > r["trace_lru_hit_rate"], r
assert r["tier"]["keys_only"] == 1 and r["tier"]["hit_blocks"] > 0, r["tier"]
rate, lru = r["first_admission_hit_rate"], r["trace_tier_lru_hit_rate"]
assert rate >= 0.9 * lru, (rate, lru)
print("trace: %.1f%% with the tier, pool+tier LRU %.1f%%, pool LRU %.1f%%" % (
    100 * rate, 100 * lru, 100 * r["trace_lru_hit_rate"]))
PY
echo "check_simulate_tier: $rows refusals and 7 runs ok"
