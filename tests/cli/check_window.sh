#!/bin/sh
# check_window.sh WORKDIR COMMAND...
# `kvpager simulate --window W --full-every K --sink-tokens S` (issue 21)
# against the kvpager program (COMMAND, possibly behind a wrapper):
#   - refusals: each bad value or combination exits 2 with one line naming
#     the flag and the value, nothing run (refusal.sh), in both the
#     `--flag v` and `--flag=v` forms;
#   - a small hybrid run (3 layers, --full-every 3: layers 0 and 1 slide,
#     layer 2 is full) with --verify: the --json "windows" keys and values,
#     no mismatch, the run with every layer full clean, the text report's
#     lines; `--flag=v` gives the same run as `--flag v`;
#   - the pages a sliding layer holds after a step stay within its bound
#     (ceil(W / bt) + 1 blocks per sequence), and pages were released;
#   - sinks: verified, fewer pages released;
#   - W = capacity releases nothing and admits as every layer full does.
set -u
work=$1
shift
rm -rf "$work"
mkdir -p "$work" || exit 1
fail() { echo "check_window: $*" >&2; exit 1; }
. "$(dirname "$0")/refusal.sh"

rows=0
refuse() { # refuse NAME FLAG VALUE ARGS...
    name=$1 flag=$2 value=$3
    shift 3
    rm -f "$work/ran.svg"
    "$@" --plot "$work/ran.svg" > "$work/out" 2> "$work/err" < /dev/null
    code=$?
    expect_refusal "$name" "$flag" "$value"
}
S="$* simulate"
ok="--no-sharing --capacity 128"
refuse window_zero --window "'0'" $S $ok --window 0
refuse window_zero_eq --window "'0'" $S $ok --window=0
refuse window_above_capacity --window "'129'" $S $ok --window 129
refuse window_not_a_number --window "'8k'" $S $ok --window 8k
refuse window_negative --window "'-1'" $S $ok --window=-1
refuse window_twice --window "--window" $S $ok --window 8 --window 9
refuse window_allocator_only --window "'8'" $S $ok --window 8 --no-compute
refuse full_every_one --full-every "'1'" $S $ok --window 8 --full-every 1
refuse full_every_zero_eq --full-every "'0'" $S $ok --window 8 --full-every=0
refuse full_every_without_window --full-every "'6'" $S $ok --full-every 6
refuse sinks_without_window --sink-tokens "'4'" $S $ok --sink-tokens=4
refuse sinks_above_capacity --sink-tokens "'200'" $S $ok --window 8 --sink-tokens 200
refuse long_context_needs_capacity --capacity "8448" $S $ok --window 8 --profile long-context
echo "check_window: $rows refusals ok"

"$@" simulate --help > "$work/help.txt" || fail "--help failed"
for flag in "--window W" "--full-every K" "--sink-tokens S" "long-context"; do
    grep -q -- "$flag" "$work/help.txt" || fail "--help does not describe $flag"
done
grep -q "layers 5, 11, ... full" "$work/help.txt" || fail "--help does not say which layers are full"

# A small hybrid run: W 8, bt 4 (a sliding layer holds at most 3 blocks after a step).
small="--layers 3 --full-every 3 --no-sharing --requests 12 --prompt-mean 40 --output-mean 12
       --sigma 0.05 --capacity 128 --block-tokens 4 --budget 512KiB --arrival burst --verify 3
       --quiet"
"$@" simulate $small --window 8 --json > "$work/w.json" || fail "the windowed run failed"
"$@" simulate $small --window=8 --json > "$work/w_eq.json" || fail "--window=8 failed"
"$@" simulate $small --window 8 > "$work/w.txt" || fail "the windowed report failed"
"$@" simulate $small --window 128 --json > "$work/cap.json" || fail "W = capacity failed"
"$@" simulate $small --window 8 --sink-tokens 4 --json > "$work/sink.json" || fail "sinks failed"
python3 - "$work" <<'PY' || fail "windowed figures"
import json, sys
d = sys.argv[1]
w, eq, cap = (json.load(open(f"{d}/{n}.json")) for n in ("w", "w_eq", "cap"))
win = w["windows"]
assert set(win) == {"window", "full_every", "sink_tokens", "sliding_layers", "full_layers",
                    "peak_sliding_pages", "peak_full_pages", "sliding_pages_released",
                    "full_concurrency_ratio", "every_layer_full"}, sorted(win)
assert (win["window"], win["full_every"], win["sink_tokens"]) == (8, 3, 0)
assert (win["sliding_layers"], win["full_layers"]) == (2, 1)
full = win["every_layer_full"]
assert set(full) == {"requests_completed", "tokens_generated", "tokens_per_second", "seconds",
                     "steps", "peak_concurrent_sequences", "mean_concurrent_sequences",
                     "peak_held_pages", "preemptions", "prefix_hit_rate", "pages_leaked",
                     "audit_failures"}
assert w["requests_completed"] == full["requests_completed"] == 12
assert w["pages_leaked"] == 0 and w["audit_failures"] == 0
assert full["pages_leaked"] == 0 and full["audit_failures"] == 0
assert w["verified"] > 0 and w["verify_mismatches"] == 0, (w["verified"], w["verify_mismatches"])
assert win["sliding_pages_released"] > 0
# After a step a sliding lane holds the blocks of [len - W, len): at most 8 / 4 + 1 = 3.
assert 0 < win["peak_sliding_pages"] <= 2 * 3 * w["peak_concurrent_sequences"], win
assert win["peak_full_pages"] > 0
assert win["full_concurrency_ratio"] == w["peak_concurrent_sequences"] / full["peak_concurrent_sequences"]
assert w["peak_concurrent_sequences"] > full["peak_concurrent_sequences"], (w, full)
# --window=8 and --window 8: the same run.
for k in ("steps", "output_checksum", "peak_concurrent_sequences", "page_acquires"):
    assert w[k] == eq[k], k
# W = capacity: nothing released, the same admissions as every layer full.
cw = cap["windows"]
assert cw["sliding_pages_released"] == 0
assert cap["peak_concurrent_sequences"] == cw["every_layer_full"]["peak_concurrent_sequences"]
assert cap["steps"] == cw["every_layer_full"]["steps"]
# Sinks: the first 4 positions (one block) are never released.
sk = json.load(open(f"{d}/sink.json"))
assert sk["windows"]["sink_tokens"] == 4 and sk["verify_mismatches"] == 0 and sk["verified"] > 0
assert sk["pages_leaked"] == 0 and sk["audit_failures"] == 0
assert sk["windows"]["peak_sliding_pages"] <= 2 * 4 * sk["peak_concurrent_sequences"]
assert 0 < sk["windows"]["sliding_pages_released"] < win["sliding_pages_released"]
print("check_window: windowed run, every-layer-full run and W = capacity agree")
PY

# Sharing over windows: a shared 16-token preamble, sample forks; exact outputs,
# hits in both runs, and the report's hit-rate row.
shared="--layers 3 --full-every 3 --shared-prefix 16 --samples 2 --requests 12 --prompt-mean 40
        --output-mean 12 --sigma 0.05 --capacity 128 --block-tokens 4 --budget 512KiB
        --arrival burst --verify 3 --quiet"
"$@" simulate $shared --window 8 --json > "$work/sh.json" || fail "the windowed sharing run failed"
"$@" simulate $shared --window 8 > "$work/sh.txt" || fail "the windowed sharing report failed"
python3 - "$work" <<'PY' || fail "windowed sharing figures"
import json, sys
sh = json.load(open(f"{sys.argv[1]}/sh.json"))
full = sh["windows"]["every_layer_full"]
assert sh["verified"] > 0 and sh["verify_mismatches"] == 0, (sh["verified"], sh["verify_mismatches"])
assert sh["pages_leaked"] == 0 and sh["audit_failures"] == 0 and full["audit_failures"] == 0
assert sh["requests_completed"] == full["requests_completed"] == 12
assert sh["prefix_hit_rate"] > 0 and full["prefix_hit_rate"] > 0, (sh["prefix_hit_rate"], full)
print("check_window: sharing over windows: hit rate %.3f (every layer full %.3f)"
      % (sh["prefix_hit_rate"], full["prefix_hit_rate"]))
PY
grep -qF -- "  prefix hit rate (%)" "$work/sh.txt" || fail "the sharing report lacks its hit-rate row"
for line in "sliding windows         W 8, sink tokens 0: 2 sliding and 1 full layers (full: 2)" \
            "pages held by kind      peak after a step: sliding layers" \
            "sliding pages released" "every layer full        the same workload again" \
            "  concurrent peak"; do
    grep -qF -- "$line" "$work/w.txt" || fail "the report lacks: $line"
done
echo "check_window: ok"
