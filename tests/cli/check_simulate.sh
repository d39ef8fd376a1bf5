#!/bin/sh
# check_simulate.sh WORKDIR full|quick COMMAND...
# Checks `kvpager simulate` end to end. COMMAND is the kvpager program,
# possibly behind a wrapper such as Valgrind memcheck (whose error exit code
# then fails the check).
#   full   help, JSON keys and values, that the schedule depends neither on
#          threads nor on the attention arithmetic, one long request on 1
#          and 2 threads (the second helps its attention) with the same
#          outputs, trace files (good ones run; bad ones are refused with
#          line, column and value, and run nothing), a one-row trace's
#          figures against values computed by hand, the exact --json key
#          set, the labels (what each line counts), the SVG plot, the sharegpt targets at
#          the default budget, and conversations' closed-loop turns.
#   quick  one small simulation with real attention on two threads.
set -eu
work=$1
mode=$2
shift 2
mkdir -p "$work"
fail() { echo "check_simulate: $*" >&2; exit 1; }

json_get() { # json_get FILE KEY
    python3 -c 'import json,sys; v=json.load(open(sys.argv[1]))[sys.argv[2]]; print(v)' "$1" "$2"
}

if [ "$mode" = quick ]; then
    "$@" simulate --requests 6 --prompt-mean 12 --output-mean 10 --capacity 128 \
        --budget 256KiB --threads 2 --audit-every 4 --json --quiet > "$work/quick.json"
    [ "$(json_get "$work/quick.json" requests_completed)" = 6 ] || fail "quick run incomplete"
    [ "$(json_get "$work/quick.json" pages_leaked)" = 0 ] || fail "quick run leaked pages"
    [ "$(json_get "$work/quick.json" audit_failures)" = 0 ] || fail "quick run failed an audit"
    echo "check_simulate: quick ok"
    exit 0
fi

"$@" simulate --help > "$work/help.txt"
grep -q -- '--trace FILE' "$work/help.txt" || fail "--help does not describe --trace"
grep -q -- '--kv-dtype NAME' "$work/help.txt" || fail "--help does not describe --kv-dtype"
grep -q -- '--schedule NAME' "$work/help.txt" || fail "--help does not describe --schedule"
grep -q -- '--session-ttl N' "$work/help.txt" || fail "--help does not describe --session-ttl"

small="--requests 40 --prompt-mean 40 --output-mean 60 --capacity 512 --budget 1MiB --quiet --json"
"$@" simulate $small --threads 2 > "$work/two.json"
"$@" simulate $small --threads 1 > "$work/one.json"
"$@" simulate $small --no-compute > "$work/none.json"
python3 - "$work/two.json" "$work/one.json" "$work/none.json" <<'PY'
import json, sys
two, one, none = (json.load(open(p)) for p in sys.argv[1:4])
keys = ["requests_completed", "tokens_generated", "tokens_per_second",
        "peak_concurrent_sequences", "contiguous_baseline_sequences", "concurrency_ratio",
        "peak_pool_utilization", "mean_pool_utilization", "internal_fragmentation",
        "preemptions", "pages_leaked", "audit_failures"]
missing = [k for k in keys if k not in two]
assert not missing, f"missing keys {missing}"
assert two["requests_completed"] == 40, two["requests_completed"]
assert two["pages_leaked"] == 0 and two["audit_failures"] == 0
assert two["page_acquires"] == two["page_releases"] > 0
assert 0.0 < two["peak_pool_utilization"] <= 1.0
assert 0.0 <= two["internal_fragmentation"] < 1.0
# Threads change nothing but speed: the same outputs, bit for bit.
assert two["output_checksum"] == one["output_checksum"], "threads changed the outputs"
# The schedule does not depend on attention outputs: allocator-only runs match.
same = ["steps", "preemptions", "peak_concurrent_sequences", "tokens_generated",
        "prefill_tokens", "internal_fragmentation", "page_acquires"]
for k in same:
    assert two[k] == none[k], f"{k}: computed {two[k]} vs allocator-only {none[k]}"
print("check_simulate: json, threads and allocator-only runs agree")
PY

# One long request: its prefill and decode run alone, and the second thread
# helps with its attention (the decoder's assist: position chunks, rows and
# feature slices of one sequence, an exact partition), so one thread and two
# must give the same outputs bit for bit (f64, and f32 with a group of 2).
long="--requests 1 --prompt-mean 1200 --output-mean 16 --sigma 0.05 --capacity 2048
      --budget 64MiB --quiet --json"
for dtype in f64 f32; do
    "$@" simulate $long --kv-dtype $dtype --kv-heads 2 --threads 1 > "$work/long1-$dtype.json"
    "$@" simulate $long --kv-dtype $dtype --kv-heads 2 --threads 2 > "$work/long2-$dtype.json"
done
python3 - "$work" <<'PY'
import json, sys
for dtype in ("f64", "f32"):
    one, two = (json.load(open(f"{sys.argv[1]}/long{t}-{dtype}.json")) for t in (1, 2))
    assert one["requests_completed"] == two["requests_completed"] == 1
    assert one["prefill_tokens"] >= 1000, one["prefill_tokens"]
    assert two["pages_leaked"] == 0 and two["audit_failures"] == 0
    assert one["output_checksum"] == two["output_checksum"], f"{dtype}: threads changed one request"
print("check_simulate: one long request gives the same outputs on 1 and 2 threads")
PY

# --kv-dtype: every dtype runs clean; the report names the dtype and, from
# the pool's pages, how many more full-capacity sequences it holds than f64.
for dtype in f64 f32 bf16 f16 fp8_e4m3; do
    "$@" simulate --requests 8 --prompt-mean 12 --output-mean 10 --capacity 128 \
        --budget 1MiB --threads 2 --kv-dtype $dtype --quiet --json > "$work/$dtype.json"
done
# The fast level: the same schedule, outputs close to the exact level's but not its bits.
"$@" simulate --requests 8 --prompt-mean 12 --output-mean 10 --capacity 128 \
    --budget 1MiB --threads 2 --kv-dtype bf16 --accum fast --quiet --json > "$work/bf16-fast.json"
"$@" simulate --requests 4 --prompt-mean 12 --output-mean 10 --capacity 128 \
    --budget 256KiB --kv-dtype bf16 --quiet > "$work/bf16.txt"
grep -q 'kv_dtype bf16' "$work/bf16.txt" || fail "the report does not name the kv dtype"
grep -q 'kv dtype                bf16, 2 bytes per element' "$work/bf16.txt" ||
    fail "the report lacks the kv dtype line"
python3 - "$work" <<'PY'
import json, sys
runs = {d: json.load(open(f"{sys.argv[1]}/{d}.json"))
        for d in ("f64", "f32", "bf16", "f16", "fp8_e4m3")}
fast = json.load(open(f"{sys.argv[1]}/bf16-fast.json"))
assert fast["config"]["accum"] == "fast" and runs["bf16"]["config"]["accum"] == "exact"
assert fast["steps"] == runs["bf16"]["steps"] and fast["requests_completed"] == 8
assert fast["output_checksum"] != runs["bf16"]["output_checksum"]
for d, r in runs.items():
    assert r["kv_dtype"] == d and r["config"]["kv_dtype"] == d, (d, r["kv_dtype"])
    assert r["requests_completed"] == 8 and r["pages_leaked"] == 0 and r["audit_failures"] == 0
    size = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "fp8_e4m3": 1}[d]
    assert r["kv_element_bytes"] == size
    # Same positions per page: the page shrinks with the element, the page count grows.
    assert r["page_bytes"] * 8 == runs["f64"]["page_bytes"] * size, (d, r["page_bytes"])
    assert r["total_pages"] == 1024 * 1024 // r["page_bytes"]
    # 128 positions of 16 per page, 2 layers: 16 pages per full-capacity sequence.
    assert r["full_capacity_sequences"] == r["total_pages"] // 16
    assert r["f64_full_capacity_sequences"] == runs["f64"]["full_capacity_sequences"]
    assert r["sequences_vs_f64"] == r["full_capacity_sequences"] / r["f64_full_capacity_sequences"]
assert runs["f64"]["sequences_vs_f64"] == 1.0
assert runs["f32"]["sequences_vs_f64"] == 2.0 and runs["bf16"]["sequences_vs_f64"] == 4.0
assert runs["f16"]["sequences_vs_f64"] == 4.0 and runs["fp8_e4m3"]["sequences_vs_f64"] == 8.0
# The schedule never waits for pages here, so every dtype runs the same steps;
# the outputs differ (rounded K/V) but stay close to f64's.
assert len({r["steps"] for r in runs.values()}) == 1
assert runs["f32"]["output_checksum"] != runs["f64"]["output_checksum"]
print("check_simulate: --kv-dtype f64, f32, bf16, f16 and fp8_e4m3 agree with their page geometry;"
      " --accum fast runs the same schedule")
PY
# f16 and fp8 (also spelled "fp8"): the pool's page geometry and what it holds,
# scheduled without compute (attention over them is the kernels' part).
for dtype in f64 f16 fp8_e4m3 fp8; do
    "$@" simulate --requests 8 --prompt-mean 12 --output-mean 10 --capacity 128 \
        --budget 1MiB --no-compute --kv-dtype $dtype --quiet --json > "$work/nc-$dtype.json"
done
python3 - "$work" <<'PY'
import json, sys
runs = {d: json.load(open(f"{sys.argv[1]}/nc-{d}.json")) for d in ("f64", "f16", "fp8_e4m3", "fp8")}
for d, size, more in (("f16", 2, 4.0), ("fp8_e4m3", 1, 8.0), ("fp8", 1, 8.0)):
    r = runs[d]
    assert r["kv_dtype"] == r["config"]["kv_dtype"] == ("fp8_e4m3" if d == "fp8" else d), d
    assert r["kv_element_bytes"] == size and r["page_bytes"] * 8 == runs["f64"]["page_bytes"] * size
    assert r["requests_completed"] == 8 and r["pages_leaked"] == 0 and r["audit_failures"] == 0
    assert r["sequences_vs_f64"] == more, (d, r["sequences_vs_f64"])
print("check_simulate: --kv-dtype f16 and fp8_e4m3 (fp8) agree with their page geometry")
PY
# Grouped-query heads: pages hold the KV heads only, so the same budget holds
# heads / kv-heads times the pages; the default is kv_heads = heads.
grep -q -- '--kv-heads N' "$work/help.txt" || fail "--help does not describe --kv-heads"
"$@" simulate $small --threads 2 --kv-heads 1 > "$work/mqa.json"
"$@" simulate $small --threads 1 --kv-heads 1 > "$work/mqa1.json"
"$@" simulate $small --threads 2 --kv-heads 2 > "$work/gqa.json"
python3 - "$work/two.json" "$work/mqa.json" "$work/mqa1.json" "$work/gqa.json" <<'PY'
import json, sys
mha, mqa, mqa1, gqa = (json.load(open(p)) for p in sys.argv[1:5])
c = mha["config"]
assert c["kv_heads"] == c["heads"] == 4, c
assert mqa["config"]["kv_heads"] == 1 and gqa["config"]["kv_heads"] == 2
for r, kv in ((mha, 4), (gqa, 2), (mqa, 1)):
    # 2 (K and V) x 2 layers x kv x d_h 16 x 8 bytes per token; pages of 16 positions.
    assert r["config"]["kv_bytes_per_token"] == 2 * 2 * kv * 16 * 8, r["config"]
    assert r["page_bytes"] == 2 * 16 * kv * 16 * 8, r["page_bytes"]
    assert r["total_pages"] == (1 << 20) // r["page_bytes"], r["total_pages"]
    assert r["requests_completed"] == 40, r["requests_completed"]
    assert r["pages_leaked"] == 0 and r["audit_failures"] == 0
assert mqa["contiguous_baseline_sequences"] >= 4 * mha["contiguous_baseline_sequences"]
assert mqa["output_checksum"] == mqa1["output_checksum"], "threads changed grouped outputs"
assert mqa["output_checksum"] != mha["output_checksum"], "kv_heads changed nothing"
print("check_simulate: --kv-heads 1 and 2 run, pages and baseline scale with kv_heads")
PY
"$@" simulate --requests 6 --prompt-mean 12 --output-mean 10 --capacity 128 --budget 256KiB \
    --kv-heads 2 --quiet > "$work/gqa.txt"
grep -q '4 heads, 2 KV heads' "$work/gqa.txt" || fail "the report lacks the KV heads: $(head -2 "$work/gqa.txt")"

# A good trace runs exactly its rows.
printf 'arrival_step,prompt_tokens,output_tokens\n0,5,4\n0,7,3\n2,3,9\n' > "$work/good.csv"
"$@" simulate --trace "$work/good.csv" --capacity 64 --budget 64KiB --quiet --json \
    > "$work/trace.json"
[ "$(json_get "$work/trace.json" requests_completed)" = 3 ] || fail "trace run incomplete"
[ "$(json_get "$work/trace.json" tokens_generated)" = 16 ] || fail "trace run generated wrong tokens"

# One request, figures computed by hand. The trace row 0,20,5 with capacity
# 64 and a 300 KiB budget on the default model (2 layers, width 64, 4 heads
# of d_h 16, f64, 16 positions per page):
#   page = 2 (K, V) x 4 heads x 16 positions x 16 x 8 bytes = 16 KiB, so 18
#   pages. Step 0 prefills 20 tokens and decodes one; each step decodes one
#   more, and the fifth token retires the request: 5 steps. After steps 1-4
#   the sequence holds 21..24 positions in ceil(/16) = 2 blocks per layer,
#   4 pages = 64 slots; after step 5 none.
#   held slots = 4 x 64 = 256; used = 2 layers x (21 + 22 + 23 + 24) = 180;
#   internal fragmentation = (256 - 180) / 256 = 0.296875.
#   contiguous baseline: one sequence reserves 2 layers x 64 positions x 2
#   (K, V) x 64 (4 x 16) x 8 bytes = 128 KiB; floor(300 / 128) = 2, ratio
#   peak 1 / 2 = 0.5.
#   utilization: peak 4 / 18, mean (4 x 4 / 18 + 0) / 5 steps.
printf 'arrival_step,prompt_tokens,output_tokens\n0,20,5\n' > "$work/one.csv"
for compute in "" --no-compute; do
    "$@" simulate --trace "$work/one.csv" --capacity 64 --budget 300KiB $compute --quiet --json \
        > "$work/one$compute.json"
    "$@" simulate --trace "$work/one.csv" --capacity 64 --budget 300KiB $compute --quiet \
        > "$work/one$compute.txt"
    python3 - "$work/one$compute.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
def exact(key, want, tolerance=1e-12):
    assert abs(r[key] - want) <= tolerance, f"{key}: {r[key]}, by hand {want}"
exact("steps", 5); exact("tokens_generated", 5); exact("prefill_tokens", 20)
exact("total_pages", 18); exact("page_bytes", 16384)
exact("internal_fragmentation", (256 - 180) / 256)
exact("contiguous_baseline_sequences", 2)
exact("peak_concurrent_sequences", 1)
exact("concurrency_ratio", 0.5)
exact("peak_pool_utilization", 4 / 18)
exact("mean_pool_utilization", 4 * 4 / 18 / 5)
exact("mean_concurrent_sequences", 1)
exact("page_acquires", 4); exact("page_releases", 4)
exact("full_capacity_sequences", 2); exact("sequences_vs_f64", 1)
assert r["targets_met"] is False  # fragmentation 30% and ratio 0.5 miss both targets
# Latency (nearest rank over the one request): arrived, admitted and first token
# in step 0, its 5th token in step 4: queue 0, TTFT 1, E2E 5, TPOT (5 - 1) / 4 = 1.
lat = r["latency"]
assert lat["requests"] == 1, lat
for key, want in (("queue_steps", 0), ("ttft_steps", 1), ("e2e_steps", 5), ("tpot_steps", 1),
                  ("recomputed_tokens", 0)):
    assert lat[key] == {"p50": want, "p90": want, "p99": want}, (key, lat[key])
seconds = ("queue_seconds", "ttft_seconds", "tpot_seconds", "e2e_seconds")
if r["config"]["compute"]:
    assert all(lat[k]["p50"] is not None and lat[k]["p50"] >= 0 for k in seconds), lat
else:  # allocator only: no seconds
    assert all(lat[k]["p50"] is None for k in seconds), lat
PY
    grep -qx '  queueing              0 / 0 / 0 steps' "$work/one$compute.txt" ||
        fail "the report's queueing line: $(grep queueing "$work/one$compute.txt")"
    grep -qx '  end to end            5 / 5 / 5 steps' "$work/one$compute.txt" ||
        fail "the report's end-to-end line: $(grep 'end to end' "$work/one$compute.txt")"
    grep -qx 'internal fragmentation  29.69% of held slots' "$work/one$compute.txt" ||
        fail "the report's fragmentation is not 29.69%: $(grep fragmentation "$work/one$compute.txt")"
    grep -qx 'contiguous baseline     2 sequences fit when each reserves its full capacity;' \
        "$work/one$compute.txt" || fail "the report's baseline is not 2 sequences"
    grep -qx '                        paging held 1 at peak: 0.50x' "$work/one$compute.txt" ||
        fail "the report's ratio is not 0.50x"
    grep -qx 'pool utilization        peak 22.2%, mean 17.8%' "$work/one$compute.txt" ||
        fail "the report's utilization is not peak 22.2%, mean 17.8%"
done

# The --json key set, exactly: every key, nothing more (a new key is added here too).
python3 - "$work/one.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
top = {"requests", "requests_completed", "requests_rejected", "tokens_generated",
       "prefill_tokens", "tokens_per_second", "seconds", "steps", "peak_concurrent_sequences",
       "workload_prompt_tokens", "recomputed_tokens", "steps_per_second",
       "mean_concurrent_sequences", "contiguous_baseline_sequences", "concurrency_ratio",
       "peak_pool_utilization", "mean_pool_utilization", "internal_fragmentation",
       "preemptions", "pages_leaked", "audit_failures", "audits", "page_acquires",
       "page_releases", "total_pages", "page_bytes", "kv_dtype", "kv_element_bytes",
       "full_capacity_sequences", "f64_full_capacity_sequences", "sequences_vs_f64",
       "output_checksum", "targets_met", "config",
       "prompt_tokens", "prefix_hit_tokens", "prefix_hit_rate", "pages_saved_ratio",
       "peak_held_pages", "mean_held_pages", "forks", "evictions", "cow_copies",
       "weight_updates", "stale_preemptions", "update_windows", "verified",
       "verify_mismatches", "verify_segments", "verify_skipped", "later_turns", "turn_gap_min",
       "session_keeps", "session_hits", "session_drops", "tier",
       "sharing_concurrency_ratio", "no_sharing",
       "trace_ceiling_hit_rate", "trace_ceiling_block_hit_rate", "trace_lru_blocks",
       "trace_lru_hit_rate", "trace_lru_block_hit_rate", "first_admission_hit_tokens",
       "trace_tier_lru_blocks", "trace_tier_lru_hit_rate",
       "first_admission_hit_rate", "hit_rate_of_ceiling", "latency"}
config = {"workload", "arrival", "rate", "mean_prompt_tokens", "mean_output_tokens", "layers",
          "model_width", "heads", "kv_heads", "kv_bytes_per_token", "block_tokens",
          "budget_bytes", "kv_dtype", "accum", "capacity", "threads", "seed", "watermark",
          "reserve_tokens", "compute", "samples", "shared_prefix", "sharing", "schedule",
          "update_weights_every", "verify_every", "session_ttl", "trace_format", "ms_per_step"}
assert set(r) == top, f"keys: missing {sorted(top - set(r))}, unexpected {sorted(set(r) - top)}"
assert set(r["config"]) == config, \
    f"config keys: missing {sorted(config - set(r['config']))}, " \
    f"unexpected {sorted(set(r['config']) - config)}"
c = r["config"]
assert c["workload"].endswith("one.csv") and c["arrival"] == "trace" and c["seed"] == 1
assert c["schedule"] == "fcfs"
assert c["capacity"] == 64 and c["budget_bytes"] == 300 * 1024 and c["block_tokens"] == 16
assert r["audits"] >= 1 and r["seconds"] >= 0.0
print("check_simulate: a one-row trace matches its hand-computed figures; the JSON keys are exact")
PY

# Labels that say what they count (issue 19, section 5). A tight pool, so
# requests are preempted and recomputed:
#   - no "targets" line (internal goals; targets_met stays in --json);
#   (no request is rejected, so every prompt is admitted once at least)
#   - "tokens generated" alone; "prompt tokens": the workload's prompts, each
#     once; "recomputed tokens": prefilled again after preemption. With one
#     sample, prefill = prompts - first-admission hits + recomputed, exactly;
#   - an allocator-only run's throughput is in steps/s, not generated tokens/s;
#   - an f64 run's kv dtype line has no "+0 (1.00x)" against itself.
lab="--requests 30 --prompt-mean 40 --output-mean 30 --capacity 256 --budget 768KiB --quiet"
"$@" simulate $lab --no-compute --json > "$work/labels.json"
"$@" simulate $lab --no-compute > "$work/labels.txt"
expected=$(python3 - "$work/labels.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["preemptions"] > 0 and r["recomputed_tokens"] > 0 and r["requests_rejected"] == 0, r
assert r["prefill_tokens"] == (r["workload_prompt_tokens"] - r["first_admission_hit_tokens"]
                               + r["recomputed_tokens"]), r
assert r["steps_per_second"] > 0
print(f"tokens generated        {r['tokens_generated']}")
print(f"prompt tokens           {r['workload_prompt_tokens']} (the workload's, each request's "
      f"once), {r['first_admission_hit_tokens']} of them adopted")
print(f"recomputed tokens       {r['recomputed_tokens']} (prefilled again after preemption)")
PY
)
printf '%s\n' "$expected" | while IFS= read -r line; do
    grep -qxF "$line" "$work/labels.txt" || fail "the report lacks '$line'"
done
if grep -q 'targets' "$work/labels.txt"; then
    fail "the report still prints the internal targets line"
fi
grep -q '^throughput              [0-9.]* steps/s over' "$work/labels.txt" ||
    fail "an allocator-only run's throughput is not in steps/s: $(grep throughput "$work/labels.txt")"
if grep -q 'generated tokens/s' "$work/labels.txt"; then
    fail "an allocator-only run reports generated tokens/s"
fi
grep -qx 'kv dtype                f64, 8 bytes per element: the pages hold [0-9]* full-capacity sequences' \
    "$work/labels.txt" || fail "the f64 dtype line: $(grep -A1 'kv dtype' "$work/labels.txt")"
if grep -q '(1.00x)' "$work/labels.txt"; then
    fail "the f64 run compares f64 with itself"
fi
# A computed run keeps generated tokens/s.
"$@" simulate --requests 4 --prompt-mean 8 --output-mean 8 --capacity 64 --quiet \
    > "$work/labels-compute.txt"
grep -q '^throughput              [0-9.]* generated tokens/s over' "$work/labels-compute.txt" ||
    fail "a computed run's throughput: $(grep throughput "$work/labels-compute.txt")"
# A sharing workload's comparison run is announced in the report, with its time,
# and its seconds are in --json.
cmp_="--requests 6 --prompt-mean 12 --output-mean 8 --capacity 64 --samples 2 --no-compute --quiet"
"$@" simulate $cmp_ > "$work/compare.txt"
"$@" simulate $cmp_ --json > "$work/compare.json"
grep -qx 'comparison run          the same workload again without sharing (--no-sharing),' \
    "$work/compare.txt" || fail "the comparison run is not announced"
grep -q '^                        run after this one for the figures below: [0-9.]* s$' \
    "$work/compare.txt" || fail "the comparison run's time is not reported"
python3 - "$work/compare.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["no_sharing"]["seconds"] >= 0, r["no_sharing"]
PY

# Bad traces: a clear error with line, column and value, and nothing runs.
while IFS='|' read -r content expected; do
    printf "$content" > "$work/bad.csv"
    if "$@" simulate --trace "$work/bad.csv" --capacity 64 --quiet \
        > "$work/bad.out" 2> "$work/bad.err"; then
        fail "a bad trace was accepted: $content"
    fi
    [ ! -s "$work/bad.out" ] || fail "a bad trace still ran: $(cat "$work/bad.out")"
    grep -qF -- "$expected" "$work/bad.err" || fail "expected '$expected', got: $(cat "$work/bad.err")"
done <<'TRACES'
0,5,4\n1,abc,3\n|bad.csv:2: column prompt_tokens: 'abc'
0,5,4\n\n1,2,-3\n|bad.csv:3: column output_tokens: '-3'
0,5\n|bad.csv:1: expected 3 columns
0,60,10\n|bad.csv:1: column output_tokens: '10'
x,1,1\n|bad.csv:1: column arrival_step: 'x'
0,0,5\n|column prompt_tokens: '0'
TRACES

# Usage errors exit 2.
status=0
"$@" simulate --budget lots > /dev/null 2>&1 || status=$?
[ "$status" = 2 ] || fail "a bad --budget exited $status, not 2"
status=0
"$@" simulate --session-ttl soon > /dev/null 2> "$work/ttl.err" || status=$?
[ "$status" = 2 ] || fail "a bad --session-ttl exited $status, not 2"
[ "$(wc -l < "$work/ttl.err")" = 1 ] && grep -q -- "--session-ttl: 'soon'" "$work/ttl.err" ||
    fail "a bad --session-ttl is not one line naming the flag and value"
status=0
"$@" simulate --schedule lifo > /dev/null 2> "$work/schedule.err" || status=$?
[ "$status" = 2 ] || fail "a bad --schedule exited $status, not 2"
[ "$(wc -l < "$work/schedule.err")" = 1 ] && grep -q -- "--schedule: 'lifo'" "$work/schedule.err" ||
    fail "a bad --schedule is not one line naming the flag and value"

# The plot is an SVG with both series.
"$@" simulate --requests 12 --prompt-mean 20 --output-mean 20 --capacity 128 \
    --budget 256KiB --no-compute --quiet --plot "$work/plot.svg" > "$work/plot.txt"
grep -q '<svg' "$work/plot.svg" || fail "no SVG written"
[ "$(grep -c '<polyline' "$work/plot.svg")" = 4 ] ||
    fail "the SVG lacks its four series (held, cached, evictable pages; running sequences)"

# Conversations are closed-loop: every later turn is sent after the turn
# before it finished (turn_gap_min >= 1), in the run with sharing and in the
# one without, and its prompt adopts the earlier turns' blocks. The schedule
# is the same on 1 and 2 threads and without attention; a small budget
# rejects turns, and the next turn is sent anyway (the run still ends).
conv="--profile conversation --requests 24 --prompt-mean 16 --output-mean 24 --capacity 512
      --quiet --json"
"$@" simulate $conv --budget 1MiB --threads 2 --verify 5 > "$work/conv2.json"
"$@" simulate $conv --budget 1MiB --threads 1 > "$work/conv1.json"
"$@" simulate $conv --budget 1MiB --no-compute > "$work/conv0.json"
"$@" simulate $conv --budget 256KiB --no-compute > "$work/convr.json"
"$@" simulate $conv --budget 1MiB --threads 2 --verify 5 --schedule cache-aware \
    > "$work/conva.json"
"$@" simulate $conv --budget 1MiB --threads 2 --session-ttl 0 > "$work/convk.json"
"$@" simulate $conv --budget 1MiB --threads 2 --verify 4 --update-weights-every 10 \
    > "$work/convu.json"
python3 - "$work" <<'PY'
import json, sys
two, one, none, rejecting, aware, unkept, updated = (
    json.load(open(f"{sys.argv[1]}/conv{n}.json")) for n in ("2", "1", "0", "r", "a", "k", "u"))
# --verify across weight updates (issue 16): every chosen request is verified,
# each token under the weights it was decoded with: requests 0, 4, ..., 20
# (6 sample sequences), more prefills than sequences (runs span updates),
# nothing skipped, no mismatch. Before, a run spanning an update was skipped.
assert updated["weight_updates"] > 0 and updated["requests_completed"] == 24, updated
assert updated["verified"] == 6 and updated["verify_skipped"] == 0, updated
assert updated["verify_segments"] > updated["verified"], updated
assert updated["verify_mismatches"] == 0, updated
# Sessions (default --session-ttl 128): finished turns are kept and their next
# turns admitted while kept; --session-ttl 0 keeps none; the run without
# sharing never keeps (nothing is published).
assert two["config"]["session_ttl"] == 128 and unkept["config"]["session_ttl"] == 0
assert two["session_keeps"] > 0 and two["session_hits"] > 0, two
assert two["session_keeps"] >= two["session_hits"] + two["session_drops"], two
assert unkept["session_keeps"] == unkept["session_hits"] == unkept["session_drops"] == 0
assert unkept["requests_completed"] == 24, unkept
# Cache-aware admission changes the order, not the outputs (verified bit for bit).
assert aware["config"]["schedule"] == "cache-aware", aware["config"]
assert aware["requests_completed"] == 24 and aware["verify_mismatches"] == 0, aware
assert aware["verified"] > 0, aware
for r in (two, none, rejecting):
    for run in (r, r["no_sharing"]):
        assert run["later_turns"] > 0 and run["turn_gap_min"] >= 1, run
    assert r["requests_completed"] + r["requests_rejected"] == 24, r
assert two["requests_completed"] == 24 and two["prefix_hit_rate"] > 0.3, two
assert rejecting["requests_rejected"] > 0 and rejecting["later_turns"] == 16, rejecting
assert two["verified"] > 0 and two["verify_mismatches"] == 0, two
same = ["steps", "preemptions", "prompt_tokens", "prefix_hit_tokens", "later_turns",
        "turn_gap_min", "prefill_tokens", "page_acquires", "evictions", "session_keeps",
        "session_hits", "session_drops"]
for k in same:
    assert two[k] == one[k] == none[k], f"{k}: {two[k]}, {one[k]}, {none[k]}"
assert two["output_checksum"] == one["output_checksum"], "threads changed the outputs"
print(f"check_simulate: conversation turns closed-loop, hit rate {two['prefix_hit_rate']:.2f}")
PY

# A Mooncake trace (--trace-format mooncake), made by hand. Three requests
# 100 ms apart, 4 steps apart at the default 25 ms per step, so each has
# finished before the next arrives:
#   0: 1024 tokens, blocks [1, 2]      nothing cached;
#   1:  700 tokens, blocks [1, 3]      block 1 (512 tokens) is request 0's;
#   2: 1536 tokens, blocks [1, 2, 4]   blocks 1 and 2 (1024 tokens) are.
# Ceiling: hits 512 + 1024 = 1536 of 1024 + 700 + 1536 = 3260 prompt tokens;
# 3 of 7 block references. The pool (1 MiB of 2 KiB pages, 16 positions, one
# layer) holds 512 x 16 / 512 = 16 blocks, more than the 5 distinct ones, so
# the LRU equals the ceiling; so does kvpager, every block hitting. Without
# --capacity the capacity is the longest request, 1536 + 1 = 1537.
cat > "$work/tiny.jsonl" <<'JSONL'
{"timestamp": 0, "input_length": 1024, "output_length": 2, "hash_ids": [1, 2]}
{"timestamp": 100, "input_length": 700, "output_length": 2, "hash_ids": [1, 3]}
{"timestamp": 200, "input_length": 1536, "output_length": 1, "hash_ids": [1, 2, 4]}
JSONL
moon="--trace $work/tiny.jsonl --trace-format mooncake --layers 1 --model-width 8 --heads 1 \
      --block-tokens 16 --budget 1MiB --quiet"
"$@" simulate $moon --json > "$work/tiny.json"
"$@" simulate $moon > "$work/tiny.txt"
python3 - "$work/tiny.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
def exact(key, want, tolerance=1e-12):
    assert abs(r[key] - want) <= tolerance, f"{key}: {r[key]}, by hand {want}"
exact("trace_ceiling_hit_rate", 1536 / 3260)
exact("trace_ceiling_block_hit_rate", 3 / 7)
exact("trace_lru_blocks", 16)
exact("trace_lru_hit_rate", 1536 / 3260)
exact("first_admission_hit_tokens", 1536)
exact("first_admission_hit_rate", 1536 / 3260)
exact("hit_rate_of_ceiling", 1)
exact("requests_completed", 3)
assert r["config"]["capacity"] == 1537 and r["config"]["trace_format"] == "mooncake"
assert r["config"]["ms_per_step"] == 25
assert r["pages_leaked"] == 0 and r["audit_failures"] == 0
PY
grep -q '^trace ceiling           47.1% of prompt tokens (1536 of 3260; 42.9% of 7 block' \
    "$work/tiny.txt" || fail "the report's trace ceiling line: $(grep ceiling "$work/tiny.txt")"
grep -q '^kvpager prefix hits     47.1% of prompt tokens (1536 of 3260, first admissions only): 100.0% of the ceiling' \
    "$work/tiny.txt" || fail "the report's kvpager hit line: $(grep 'prefix hits' "$work/tiny.txt")"
grep -q '^same-capacity LRU       47.1% of prompt tokens (42.9% of blocks): an LRU of 16' \
    "$work/tiny.txt" || fail "the report's LRU line: $(grep LRU "$work/tiny.txt")"
# Allocator-only memory is the page tables an external cache per layer holds, not a
# computed run's tickets of heads x capacity doubles. A hand-made trace of 256
# requests: request 0 of 8192 tokens (blocks 1-16), the others of 1024 (block 1 and
# one of their own), 100 ms apart; its longest request makes the capacity 8193. At
# 32 layers of width 4096 in 4096 heads (8 KV heads of 1), the check before charged
# each of the 256 sequences 32 x 4096 x 8193 doubles, 2 TiB in all, and refused; now
# it charges their page tables (about 40 MiB) and the run goes. The pool holds every
# block, so the 255 adoptions of block 1 (512 tokens each) are the ceiling.
# Not under Valgrind: the scheduler's publication scratch (prompt tokens x width
# doubles, 256 MiB here) is zeroed there.
case "$1" in
*valgrind*) ;;
*)
    python3 -c 'import json
print(json.dumps({"timestamp": 0, "input_length": 8192, "output_length": 1,
                  "hash_ids": list(range(1, 17))}))
for i in range(1, 256):
    print(json.dumps({"timestamp": 100 * i, "input_length": 1024, "output_length": 1,
                      "hash_ids": [1, 1000 + i]}))' > "$work/wide.jsonl"
    "$@" simulate --trace "$work/wide.jsonl" --trace-format mooncake --layers 32 \
        --model-width 4096 --heads 4096 --kv-heads 8 --kv-dtype bf16 --budget 256MiB \
        --no-compute --quiet --json > "$work/wide.json" \
        || fail "an allocator-only Mooncake run at width 4096 in 4096 heads was refused"
    python3 - "$work/wide.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["config"]["capacity"] == 8193, r["config"]["capacity"]
assert r["requests_completed"] == 256, r["requests_completed"]
assert r["first_admission_hit_tokens"] == 255 * 512, r["first_admission_hit_tokens"]
assert abs(r["trace_ceiling_hit_rate"] - 255 * 512 / (8192 + 255 * 1024)) < 1e-12
assert r["hit_rate_of_ceiling"] == 1 and r["pages_leaked"] == 0 and r["audit_failures"] == 0
PY
    ;;
esac
# A Mooncake trace with block ids makes no comparison run without sharing, and says so.
grep -q '^comparison run          none: a trace.s sharing is measured against its ceiling' \
    "$work/tiny.txt" || fail "the Mooncake report does not announce that no comparison ran"
grep -q '^side by side' "$work/tiny.txt" && fail "a Mooncake trace ran a comparison"
# A sweep over a trace with block ids: the hit rate column is the first-admission rate.
"$@" simulate --trace "$work/tiny.jsonl" --trace-format mooncake --layers 1 --model-width 8 \
    --heads 1 --block-tokens 16,32 --budget 1MiB --quiet --format csv > "$work/tiny-sweep.csv"
python3 - "$work/tiny-sweep.csv" <<'PY'
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
assert [(r["block_tokens"], r["pages"], r["completed"]) for r in rows] == [
    ("16", "512", "3"), ("32", "256", "3")], rows
for r in rows:
    assert abs(float(r["hit_rate"]) - 1536 / 3260) < 1e-6, r["hit_rate"]
PY
# The checks against the capacity wait for the trace that sets it: a request of
# 4096 + 4 tokens makes the capacity 4100, so --reserve-tokens 3000 (above the
# default capacity 2048) is within it.
printf '{"timestamp": 0, "input_length": 4096, "output_length": 4, "hash_ids": [1, 2, 3, 4, 5, 6, 7, 8]}\n' \
    > "$work/long.jsonl"
"$@" simulate --trace "$work/long.jsonl" --trace-format mooncake --layers 1 --model-width 8 \
    --heads 1 --block-tokens 16 --budget 1MiB --no-compute --reserve-tokens 3000 --quiet --json \
    > "$work/long-reserve.json" || fail "--reserve-tokens 3000 refused against the default capacity"
[ "$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r["config"]["capacity"], r["config"]["reserve_tokens"], r["requests_completed"])' "$work/long-reserve.json")" = "4100 3000 1" ] \
    || fail "the trace's capacity and --reserve-tokens: $(cat "$work/long-reserve.json")"

# The same file read as CSV is refused: the format is never guessed.
if "$@" simulate --trace "$work/tiny.jsonl" --quiet > /dev/null 2>&1; then
    fail "a Mooncake file was read without --trace-format mooncake"
fi

# Sweeps: comma lists of the main knobs, one run and one table row per combination
# (--model, --kv-dtype, --block-tokens, --budget; the last varying fastest). A small
# computed workload whose schedule is deterministic; each row's figures are the
# single run's (its --json), and the schedule's figures are exact.
grep -q -- '--format FMT' "$work/help.txt" || fail "--help does not describe --format"
grep -q '^Sweeps: --model, --kv-dtype, --block-tokens and --budget take comma lists' \
    "$work/help.txt" || fail "--help does not describe sweeps"
grep -q '^Memory (peak resident set, /usr/bin/time -v, release build' "$work/help.txt" ||
    fail "--help does not state the memory a run needs"
sweep="--requests 8 --prompt-mean 12 --output-mean 10 --capacity 128 --threads 2 --quiet"
"$@" simulate $sweep --budget 64KiB,256KiB --kv-dtype f64,bf16 > "$work/sweep.md"
"$@" simulate $sweep --budget=64KiB,256KiB --kv-dtype=f64,bf16 --format csv > "$work/sweep.csv"
"$@" simulate $sweep --budget 64KiB,256KiB --kv-dtype f64,bf16 --format json > "$work/sweep.json"
"$@" simulate $sweep --budget 64KiB,256KiB --kv-dtype f64,bf16 --json > "$work/sweep-full.json"
"$@" simulate $sweep --budget 256KiB --kv-dtype bf16 --format md > "$work/sweep-one.md"
"$@" simulate $sweep --budget 256KiB --kv-dtype bf16 > "$work/sweep-one.txt"
for d in f64 bf16; do
    for b in 64KiB 256KiB; do
        "$@" simulate $sweep --budget $b --kv-dtype $d --json > "$work/single-$d-$b.json"
    done
done
python3 - "$work" <<'PY'
import csv, json, sys
w = sys.argv[1]
columns = ["model", "layers", "model_width", "heads", "kv_heads", "kv_dtype", "block_tokens",
           "budget_bytes", "pages", "peak_concurrent", "mean_concurrent", "hit_rate",
           "preemptions", "ttft_p50_steps", "ttft_p99_steps", "e2e_p50_steps", "e2e_p99_steps",
           "completed", "requests", "steps", "seconds"]
order = [("f64", "64KiB", 65536), ("f64", "256KiB", 262144), ("bf16", "64KiB", 65536),
         ("bf16", "256KiB", 262144)]
rows = list(csv.DictReader(open(f"{w}/sweep.csv")))
table = json.load(open(f"{w}/sweep.json"))
full = json.load(open(f"{w}/sweep-full.json"))
assert open(f"{w}/sweep.csv").readline().strip() == ",".join(columns)
assert len(rows) == len(table) == len(full) == 4, (len(rows), len(table), len(full))
for i, (dtype, budget, budget_bytes) in enumerate(order):
    one = json.load(open(f"{w}/single-{dtype}-{budget}.json"))
    c, t, f = rows[i], table[i], full[i]
    assert list(t) == columns, list(t)
    assert c["kv_dtype"] == t["kv_dtype"] == f["kv_dtype"] == dtype
    assert int(c["budget_bytes"]) == t["budget_bytes"] == f["config"]["budget_bytes"] == budget_bytes
    assert c["model"] == t["model"] == "-" and t["layers"] == 2 and t["block_tokens"] == 16
    pairs = {"pages": "total_pages", "peak_concurrent": "peak_concurrent_sequences",
             "preemptions": "preemptions", "completed": "requests_completed",
             "requests": "requests", "steps": "steps"}
    for col, key in pairs.items():
        assert int(c[col]) == t[col] == f[key] == one[key], (i, col, c[col], t[col], one[key])
    assert abs(t["mean_concurrent"] - one["mean_concurrent_sequences"]) < 1e-12
    assert abs(float(c["mean_concurrent"]) - one["mean_concurrent_sequences"]) < 1e-5
    assert t["hit_rate"] == one["first_admission_hit_tokens"] / one["workload_prompt_tokens"] == 0
    assert t["ttft_p50_steps"] == one["latency"]["ttft_steps"]["p50"]
    assert t["ttft_p99_steps"] == one["latency"]["ttft_steps"]["p99"]
    assert t["e2e_p50_steps"] == one["latency"]["e2e_steps"]["p50"]
    assert t["e2e_p99_steps"] == one["latency"]["e2e_steps"]["p99"]
    assert t["seconds"] > 0 and f["output_checksum"] == one["output_checksum"]
# The figures themselves (the same schedule on any machine): pages, peak, steps, completed.
got = [(t["pages"], t["peak_concurrent"], t["steps"], t["completed"]) for t in table]
assert got == [(4, 1, 17, 2), (16, 3, 56, 8), (16, 3, 56, 8), (64, 7, 44, 8)], got
md = open(f"{w}/sweep.md").read().splitlines()
assert md[0] == "| " + " | ".join(columns) + " |", md[0]
assert md[1].startswith("| --- | ---: |") and len(md) == 6, md
assert md[2].startswith("| - | 2 | 64 | 4 | 4 | f64 | 16 | 64.0 KiB | 4 | 1 | 1.00 | 0.0% | 0 |"), md[2]
assert md[5].startswith("| - | 2 | 64 | 4 | 4 | bf16 | 16 | 256.0 KiB | 64 | 7 |"), md[5]
one_md = open(f"{w}/sweep-one.md").read().splitlines()
assert len(one_md) == 3 and one_md[2].startswith("| - | 2 | 64 | 4 | 4 | bf16 | 16 | 256.0 KiB | 64 | 7 |")
# One value of each: today's report, no table.
text = open(f"{w}/sweep-one.txt").read()
assert text.startswith("kvpager simulate: sharegpt, 8 requests") and "| model |" not in text
print("check_simulate: sweeps (md, csv, json tables and --json's array) match the single runs")
PY

# The sharegpt targets at the default budget. The schedule does not depend on
# the attention arithmetic (checked above), so the allocator-only run shows
# the same figures in a fraction of the time.
"$@" simulate --no-compute --json --quiet > "$work/sharegpt.json"
python3 - "$work/sharegpt.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["config"]["workload"] == "sharegpt"
assert r["requests_completed"] == r["requests"] - r["requests_rejected"] == 128, r
assert r["concurrency_ratio"] >= 3.0, r["concurrency_ratio"]
assert r["internal_fragmentation"] < 0.05, r["internal_fragmentation"]
assert r["pages_leaked"] == 0 and r["audit_failures"] == 0
print(f"check_simulate: sharegpt ratio {r['concurrency_ratio']:.2f}, "
      f"fragmentation {100 * r['internal_fragmentation']:.2f}%")
PY
echo "check_simulate: ok"
