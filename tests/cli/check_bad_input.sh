#!/bin/sh
# check_bad_input.sh WORKDIR COMMAND...
# Issue 7's table of bad inputs, one row per case, against the kvpager
# program (COMMAND, possibly behind a wrapper such as Valgrind memcheck).
# Each row asserts: exit status 2, exactly one line on stderr, that line
# naming the option and the value (both given per row), and that nothing ran:
# nothing on stdout and, for simulate, no file from the --plot the check adds
# to every row that does not test --plot itself (outputs are opened only
# after every input was checked, so the file must not exist).
# Then a few inputs that the same rules must accept (a UTF-8 byte order mark,
# TiB/TB budgets) and the zero-completion run, which must meet no target.
set -u
work=$1
shift
rm -rf "$work"
mkdir -p "$work/sub" || exit 1
fail() { echo "check_bad_input: $*" >&2; exit 1; }
. "$(dirname "$0")/refusal.sh"

# Fixtures.
printf 'arrival_step,prompt_tokens,output_tokens\n0,5,4\n1,3,3\n' > "$work/good.csv"
printf '\357\273\277arrival_step,prompt_tokens,output_tokens\n0,5,4\n1,3,3\n' > "$work/bom.csv"
printf '0,5,4\n1,3\0003,3\n' > "$work/nul.csv"
printf '0,5,4\n3,3,3\n1,2,2\n' > "$work/unsorted.csv"
printf '0,5,4\n0,40,30\n' > "$work/long.csv"
printf 'arrival_step,prompt_tokens,output_tokens\n\n' > "$work/empty.csv"
physical=$(( $(getconf _PHYS_PAGES) * $(getconf PAGE_SIZE) ))
above=$(( physical + 1073741824 ))

rows=0
# case NAME FLAG VALUE ARGS...: FLAG and VALUE must both appear in the one line.
case_() {
    name=$1 flag=$2 value=$3
    shift 3
    plot=
    if [ "$1" = simulate ]; then
        case " $* " in *" --plot "*) ;; *) plot="--plot $work/ran.svg" ;; esac
    fi
    rm -f "$work/ran.svg"
    # shellcheck disable=SC2086
    "$@" $plot > "$work/out" 2> "$work/err" < /dev/null
    code=$?
    expect_refusal "$name" "$flag" "$value"
    [ ! -e "$work/sub/x.svg" ] || fail "$name: a plot was left behind"
}

run() { case_ "$@"; }
k="$*"
S="$k simulate"
D="$k demo"

# ---- issue 7, section 2, row by row ------------------------------------------
run heads_zero --heads "'0'" $S --heads 0
run heads_and_width_zero --model-width "'0'" $S --heads 0 --model-width 0
run width_too_big --model-width "'99999'" $S --model-width 99999 --heads 1
run budget_10000GiB --budget "'10000GiB'" $S --budget 10000GiB
run budget_above_physical --budget "'$above'" $S --budget "$above"
run budget_1TiB_is_a_unit --budget "--allow-overcommit" $S --budget 1TiB
run budget_fraction --budget "'1.5'" $S --budget 1.5
run capacity_overflow --capacity "'18446744073709551615'" $S --capacity 18446744073709551615
run capacity_one --capacity "'1'" $S --capacity 1
run layers_zero --layers "'0'" $S --layers 0
run capacity_zero --capacity "'0'" $S --capacity 0
run requests_zero --requests "'0'" $S --requests 0
run rate_zero --rate "'0'" $S --rate 0
run watermark_one --watermark "'1'" $S --watermark 1
run model_width_zero --model-width "'0'" $S --model-width 0
run block_tokens_zero --block-tokens "'0'" $S --block-tokens 0
run budget_zero --budget "'0'" $S --budget 0
run bogus "unknown option" "'--bogus'" $S --bogus
run prompt_mean_zero --prompt-mean "'0'" $S --prompt-mean 0
run output_mean_zero --output-mean "'0'" $S --output-mean 0
run sigma_zero --sigma "'0'" $S --sigma 0
run prompt_mean_huge --prompt-mean "'1e308'" $S --prompt-mean 1e308
run prompt_mean_range "from 1 to 2047" "1e308" $S --prompt-mean 1e308
run trace_directory "--trace $work/sub" "Is a directory" $S --trace "$work/sub"
run trace_nul "--trace $work/nul.csv:2" "NUL" $S --trace "$work/nul.csv"
run trace_unsorted "--trace $work/unsorted.csv:3" "'1'" $S --trace "$work/unsorted.csv"
run trace_with_profile "--profile alpaca" "--trace $work/good.csv" \
    $S --trace "$work/good.csv" --profile alpaca --requests 5
run trace_with_requests "--requests 5" "--trace $work/good.csv" \
    $S --trace "$work/good.csv" --requests 5
printf '{"timestamp": 0, "input_length": 5, "output_length": 4, "hash_ids": [7]}\n' > "$work/moon.jsonl"
printf '{"timestamp": 0, "input_length": 5, "output_length": 4, "hash_ids": [7]}\n{"timestamp": 1, "input_length": 600, "output_length": 4, "hash_ids": [7, 8]}\n' > "$work/moon2.jsonl"
run trace_format_bogus --trace-format "'json'" $S --trace "$work/moon.jsonl" --trace-format json
run trace_format_without_trace --trace-format "mooncake" $S --trace-format mooncake
run ms_per_step_zero --ms-per-step "'0'" $S --trace "$work/moon.jsonl" --trace-format mooncake \
    --ms-per-step 0
run ms_per_step_fraction --ms-per-step "'2.5'" $S --trace "$work/moon.jsonl" \
    --trace-format mooncake --ms-per-step 2.5
run ms_per_step_without_mooncake --ms-per-step "--trace-format mooncake" \
    $S --trace "$work/good.csv" --ms-per-step 5
run ms_per_step_csv_format --ms-per-step "--trace-format mooncake" \
    $S --trace "$work/good.csv" --trace-format csv --ms-per-step 5
run mooncake_capacity "--trace $work/moon2.jsonl:2" "--capacity 100" \
    $S --trace "$work/moon2.jsonl" --trace-format mooncake --capacity 100
run mooncake_read_as_csv "--trace $work/moon.jsonl:1" "3 columns" $S --trace "$work/moon.jsonl"
# A capacity nobody typed (a Mooncake trace's longest request, 65536 + 1 tokens): a
# memory refusal names --trace, or says where the capacity came from. Enough requests
# that, with --max-running 0 (no limit but the pool: each running sequence holds a page
# per layer), their allocator-only page tables exceed physical memory about twice:
# 80 layers x (2 x 65537 + 2) entries of 4 bytes, about 42 MB a sequence, here with
# 1-token pages (4 KiB at llama-3-70b bf16) and 160 pages per request in the budget.
many=$(( physical / 20000000 + 2 ))
python3 -c 'import json, sys
ids = list(range(1, 129))
with open(sys.argv[1], "w") as f:
    for i in range(int(sys.argv[2])):
        f.write(json.dumps({"timestamp": i, "input_length": 65536, "output_length": 1,
                            "hash_ids": ids}) + "\n")' "$work/many.jsonl" "$many"
many_budget=$(( many * 160 * 4096 ))
run mooncake_memory_names_trace "invalid value for --trace: '$work/many.jsonl'" \
    "(the sequences" $S --trace "$work/many.jsonl" --trace-format mooncake --model llama-3-70b \
    --kv-dtype bf16 --block-tokens 1 --budget "$many_budget" --no-compute --max-running 0
run mooncake_memory_capacity_source "invalid value for --trace" \
    "with a capacity of 65537 tokens (its longest request) and --model llama-3-70b" \
    $S --trace "$work/many.jsonl" --trace-format mooncake --model llama-3-70b \
    --kv-dtype bf16 --block-tokens 1 --budget "$many_budget" --no-compute --max-running 0
run mooncake_memory_names_layers "invalid value for --layers: '80'" \
    "with a capacity of 65537 tokens (--trace's longest request)" \
    $S --trace "$work/many.jsonl" --trace-format mooncake --model llama-3-70b --layers 80 \
    --kv-dtype bf16 --block-tokens 1 --budget "$many_budget" --no-compute --max-running 0
# Sweeps: every value of every list is checked, each combination as a run of its own,
# before anything runs; the one line names the flag and the bad value.
run sweep_budget_below_page --budget "'1KiB'" $S --budget 64KiB,1KiB --json --requests 2
run sweep_budget_empty_item --budget "'64KiB,,256KiB'" $S --budget 64KiB,,256KiB
run sweep_budget_trailing_comma --budget "'64KiB,'" $S --budget=64KiB,
run sweep_budget_word --budget "'lots'" $S --budget 1MiB,lots
run sweep_budget_above_physical --budget "'$above'" $S --budget "16MiB,$above" --requests 2
run sweep_kv_dtype --kv-dtype "'f99'" $S --kv-dtype f64,bf16,f99
run sweep_kv_dtype_inline --kv-dtype "'f99'" $S --kv-dtype=bf16,f99
run sweep_block_tokens_zero --block-tokens "'0'" $S --block-tokens 16,0
run sweep_block_tokens_overflow --block-tokens "'18446744073709551615'" \
    $S --block-tokens 16,18446744073709551615
run sweep_model --model "'gpt'" $S --model llama-3-8b,gpt --no-compute
run sweep_model_memory --model "'llama-3-70b'" $S --model llama-3-70b,llama-3-8b \
    --budget 16MiB --requests 2
run sweep_too_many --budget "the lists make more than 256 combinations" \
    $S --block-tokens 1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17 \
    --budget 1MiB,2MiB,3MiB,4MiB,5MiB,6MiB,7MiB,8MiB,9MiB,10MiB,11MiB,12MiB,13MiB,14MiB,15MiB,16MiB
run sweep_budget_twice --budget "'lots'" $S --budget 1MiB,2MiB --kv-dtype f64,bf16 --budget lots
run format_bogus --format "'xml'" $S --format xml
run format_with_json --format "csv" $S --format csv --json --requests 2
run sweep_with_plot "--plot $work/sub/x.svg" "a sweep" $S --budget 1MiB,2MiB --plot "$work/sub/x.svg"
run format_with_plot "--plot $work/sub/x.svg" "--format" $S --format md --plot "$work/sub/x.svg"
# The capacity a Mooncake trace sets (its longest request, 600 + 4) bounds --reserve-tokens.
run mooncake_reserve_above_capacity --reserve-tokens "'700'" \
    $S --trace "$work/moon2.jsonl" --trace-format mooncake --reserve-tokens 700
run max_running_word --max-running "'all'" $S --max-running all
run max_running_negative --max-running "'-1'" $S --max-running -1
run plot_missing_dir "--plot /nonexistent/x.svg" "No such file or directory" \
    $S --plot /nonexistent/x.svg --requests 2
run plot_full_device "--plot /dev/full" "No space left on device" $S --plot /dev/full --requests 2
run plot_directory "--plot $work/sub" "Is a directory" $S --plot "$work/sub" --requests 2

# An output that names an input is refused before anything is written
# (issue 16; it used to replace the trace with the SVG and exit 0): the same
# path, another spelling of it, a symbolic link either way, a hard link
# (same device and inode), and a trace that does not exist (the same
# resolved path). The trace must be left as it was.
cp "$work/good.csv" "$work/keep.csv"
ln -s good.csv "$work/link.csv"
ln "$work/good.csv" "$work/hard.csv"
g=$work/good.csv
run plot_is_trace "--plot: '$g'" "--trace $g" $S --trace "$g" --plot "$g"
run plot_is_trace_spelled_again "--plot: '$work/sub/../good.csv'" "--trace $g" \
    $S --trace "$g" --plot "$work/sub/../good.csv"
run plot_is_trace_dot "--plot: '$work/./good.csv'" "--trace $g" $S --trace "$g" --plot "$work/./good.csv"
run plot_links_to_trace "--plot: '$work/link.csv'" "--trace $g" $S --trace "$g" --plot "$work/link.csv"
run trace_links_to_plot "--plot: '$g'" "--trace $work/link.csv" $S --trace "$work/link.csv" --plot "$g"
run plot_hard_links_trace "--plot: '$work/hard.csv'" "--trace $g" $S --trace "$g" --plot "$work/hard.csv"
run plot_is_missing_trace "--plot: '$work/sub/../none.csv'" "--trace $work/none.csv" \
    $S --trace "$work/none.csv" --plot "$work/sub/../none.csv"
cmp -s "$g" "$work/keep.csv" || fail "a refused --plot changed the --trace file"
[ -L "$work/link.csv" ] || fail "a refused --plot replaced the symbolic link"
[ ! -e "$work/none.csv" ] || fail "a refused --plot created the missing trace"

# ---- more of the same rules --------------------------------------------------
run budget_below_a_page --budget "'1KiB'" $S --budget 1KiB
run kv_dtype_unknown --kv-dtype "'fp16'" $S --kv-dtype fp16
run kv_dtype_unknown_fp8 --kv-dtype "'fp8_e5m2'" $S --kv-dtype fp8_e5m2
run kv_dtype_case --kv-dtype "'F32'" $S --kv-dtype F32
run kv_dtype_empty --kv-dtype "''" $S --kv-dtype ""
run kv_dtype_twice --kv-dtype "f32" $S --kv-dtype f32 --kv-dtype bf16
run model_unknown --model "'llama-3-9b'" $S --model llama-3-9b
run model_equals_unknown --model "'llama'" $S --model=llama
run model_too_big --model "'llama-3-70b'" $S --model llama-3-70b
run accum_unknown --accum "'slow'" $S --accum slow
run accum_equals_empty --accum "'--accum='" $S --accum=
run accum_twice --accum "exact" $S --accum exact --accum=fast
run equals_unknown_flag "unknown option" "'--lay'" $S --lay=3
run equals_layers_zero --layers "'0'" $S --layers=0
# One bf16 page (2 x 16 x 64 x 2 bytes) fits 4KiB, one f32 page does not.
run kv_dtype_f32_page_above_budget --budget "'4KiB'" $S --budget 4KiB --kv-dtype f32
run budget_bad_unit --budget "'10XB'" $S --budget 10XB
run budget_inexact_fraction --budget "'1.1KiB'" $S --budget 1.1KiB
run budget_negative --budget "'-1'" $S --budget -1
run budget_overflow --budget "'100000000000000000000'" $S --budget 100000000000000000000
run budget_TiB_overflow --budget "'20000000TiB'" $S --budget 20000000TiB
run budget_too_many_pages --budget "'70000GiB'" $S --budget 70000GiB --allow-overcommit
run heads_not_dividing --heads "'4'" $S --model-width 10 --heads 4
run width_not_multiple --model-width "'10'" $S --model-width 10
run kv_heads_zero --kv-heads "'0'" $S --kv-heads 0
run kv_heads_not_dividing --kv-heads "'3'" $S --kv-heads 3
run kv_heads_above_heads --kv-heads "'8'" $S --heads 4 --kv-heads 8
run kv_heads_fraction --kv-heads "'1.5'" $S --kv-heads 1.5
run kv_heads_given_heads "--kv-heads: '4'" "--heads 2" $S --heads 2 --kv-heads 4
run kv_heads_small_page "--budget: '1KiB'" "--kv-heads 1" $S --kv-heads 1 --budget 1KiB
run block_tokens_overflow --block-tokens "'18446744073709551615'" \
    $S --block-tokens 18446744073709551615
run layers_fraction --layers "'1.5'" $S --layers 1.5
run requests_exponent --requests "'1e3'" $S --requests 1e3
run requests_huge --requests "'100000000000000'" $S --requests 100000000000000
run threads_negative --threads "'-1'" $S --threads -1
run threads_too_many --threads "'5000'" $S --threads 5000
run seed_word --seed "'abc'" $S --seed abc
run reserve_above_capacity --reserve-tokens "'5000'" $S --reserve-tokens 5000
run sigma_huge --sigma "'5'" $S --sigma 5
run sigma_uniform --sigma "--profile uniform" $S --sigma 1 --profile uniform
run rate_huge --rate "'1e9'" $S --rate 1e9
run rate_nan --rate "'nan'" $S --rate nan
run rate_inf --rate "'inf'" $S --rate inf
run rate_hex --rate "'0x10'" $S --rate 0x10
run watermark_negative --watermark "'-0.1'" $S --watermark -0.1
run capacity_below_mean --capacity "'100'" $S --capacity 100
run capacity_below_alpaca --capacity "'64'" $S --capacity 64 --profile alpaca
run profile_unknown --profile "'bogus'" $S --profile bogus
run arrival_unknown --arrival "'bogus'" $S --arrival bogus
run profile_conversations --profile "'conversations'" $S --profile conversations
run shared_prefix_above_capacity --shared-prefix "'63'" $S --shared-prefix 63 --capacity 64 \
    --prompt-mean 8 --output-mean 8
run shared_prefix_word --shared-prefix "'x'" $S --shared-prefix x
run shared_prefix_negative --shared-prefix "'-1'" $S --shared-prefix -1
run shared_prefix_with_the_mean --shared-prefix "'1900'" $S --shared-prefix 1900
run shared_prefix_with_trace "--shared-prefix 4" "--trace" $S --trace "$work/good.csv" \
    --shared-prefix 4
run samples_zero --samples "'0'" $S --samples 0
run samples_huge --samples "'257'" $S --samples 257
run samples_fraction --samples "'1.5'" $S --samples 1.5
run update_weights_zero --update-weights-every "'0'" $S --update-weights-every 0
run update_weights_word --update-weights-every "'often'" $S --update-weights-every often
run update_weights_negative --update-weights-every "'-5'" $S --update-weights-every -5
run update_weights_no_compute --update-weights-every "--no-compute" $S --update-weights-every 10 \
    --no-compute
run verify_zero --verify "'0'" $S --verify 0
run verify_fraction --verify "'0.5'" $S --verify 0.5
run verify_no_compute --verify "--no-compute" $S --no-compute --verify 4
run verify_missing_value --verify "needs a value" $S --verify
run verify_twice --verify "'1' and '2'" $S --verify 1 --verify 2
# What --verify keeps counts against physical memory (here about 794 TiB).
run verify_memory --verify "'1'" $S --verify 1 --requests 100000 --capacity 65536 \
    --samples 256 --no-sharing
run no_sharing_value "unexpected argument" "'yes'" $S --no-sharing yes
run layers_wrapping_4L --layers "'4611686018427387904'" $S --layers 4611686018427387904
run layers_huge_memory "--layers 100000000" "'1024'" $S --layers 100000000 --model-width 1024 --heads 1
run trace_missing "--trace $work/none.csv" "No such file or directory" $S --trace "$work/none.csv"
run trace_not_a_dir "--trace $work/good.csv/x" "Not a directory" $S --trace "$work/good.csv/x"
run trace_empty "--trace $work/empty.csv" "no requests" $S --trace "$work/empty.csv"
run trace_row_over_capacity "--trace $work/long.csv:2" "column output_tokens: '30'" \
    $S --trace "$work/long.csv" --capacity 64
run trace_with_prompt_mean "--prompt-mean 10" "--trace" $S --trace "$work/good.csv" --prompt-mean 10
run trace_with_rate "--rate 2" "--trace" $S --trace "$work/good.csv" --rate 2
run trace_with_arrival "--arrival burst" "--trace" $S --trace "$work/good.csv" --arrival burst
run missing_value_at_end --layers "needs a value" $S --layers
run missing_value_option --trace "'--json'" $S --trace --json
run given_twice --layers "'2' and '3'" $S --layers 2 --layers 3
run unexpected_argument "unexpected argument" "'foo'" $S foo
run demo_bogus "unknown option" "'--bogus'" $D --bogus
run demo_argument "unexpected argument" "'extra'" $D extra
run top_bogus "unknown option" "'--bogus'" $k --bogus
run top_command "unknown command" "'bogus'" $k bogus
run top_missing "missing command" "kvpager --help" $k
run top_version_extra "--version" "'x'" $k --version x

# ---- what the same rules accept ----------------------------------------------
json_get() { python3 -c 'import json,sys; v=json.load(open(sys.argv[1]));
for k in sys.argv[2].split("."): v=v[k]
print(v)' "$1" "$2"; }
small="--capacity 64 --budget 64KiB --quiet --json --no-compute"
$S --trace "$work/bom.csv" $small > "$work/bom.json" || fail "a trace with a BOM was refused"
[ "$(json_get "$work/bom.json" requests_completed)" = 2 ] || fail "the BOM trace did not run its rows"
$S --budget 0.0000152587890625TiB --requests 4 --prompt-mean 8 --output-mean 8 --capacity 64 \
    --quiet --json --no-compute > "$work/tib.json" || fail "a TiB budget was refused"
[ "$(json_get "$work/tib.json" config.budget_bytes)" = 16777216 ] || fail "TiB is not 2^40 bytes"
$S --budget 0.000016TB --requests 4 --prompt-mean 8 --output-mean 8 --capacity 64 \
    --quiet --json --no-compute > "$work/tb.json" || fail "a TB budget was refused"
[ "$(json_get "$work/tb.json" config.budget_bytes)" = 16000000 ] || fail "TB is not 10^12 bytes"
$S --budget 1.5KiB --block-tokens 4 --model-width 8 --heads 2 --requests 1 --prompt-mean 2 \
    --output-mean 2 --capacity 8 --quiet --json --no-compute > "$work/frac.json" \
    || fail "1.5KiB (a whole byte count) was refused"
[ "$(json_get "$work/frac.json" config.budget_bytes)" = 1536 ] || fail "1.5KiB is not 1536 bytes"

# An allocator-only run's pages have no memory behind them (KVP_SLAB_RESERVED): a 1 TiB
# Llama-3-70B pool runs on any machine without --allow-overcommit; only metadata counts.
# Not under Valgrind, whose client address space is smaller than the range.
case "$1" in
*valgrind*) ;;
*)
    $S --model llama-3-70b --no-compute --budget 1TiB --kv-dtype bf16 --requests 2 \
        --prompt-mean 40 --output-mean 8 --quiet --json > "$work/tib70b.json" \
        || fail "--no-compute --budget 1TiB of llama-3-70b was refused"
    [ "$(json_get "$work/tib70b.json" total_pages)" = 16777216 ] \
        || fail "1 TiB is not 2^24 64 KiB pages"
    [ "$(json_get "$work/tib70b.json" requests_completed)" = 2 ] \
        || fail "the 1 TiB run did not complete"
    ;;
esac

# --flag=value is --flag value; --model's geometry yields to explicit flags; --accum is reported.
$S --model=llama-3-8b --layers=1 --model-width=256 --heads 16 --requests=2 --prompt-mean 8 \
    --output-mean 8 --capacity 64 --budget 1MiB --kv-dtype=bf16 --accum=fast --quiet --json \
    --no-compute > "$work/preset.json" || fail "--model with overrides was refused"
[ "$(json_get "$work/preset.json" config.layers)" = 1 ] || fail "--layers=1 did not override --model"
[ "$(json_get "$work/preset.json" config.model_width)" = 256 ] || fail "--model-width did not override"
[ "$(json_get "$work/preset.json" config.kv_heads)" = 8 ] || fail "--model did not set kv_heads 8"
[ "$(json_get "$work/preset.json" config.accum)" = fast ] || fail "--accum=fast is not reported"
$S --model qwen2.5-7b --layers 1 --model-width 448 --requests 2 --prompt-mean 8 --output-mean 8 \
    --capacity 64 --budget 4MiB --quiet --json --no-compute > "$work/qwen.json" \
    || fail "--model qwen2.5-7b was refused"
[ "$(json_get "$work/qwen.json" config.heads)" = 28 ] || fail "qwen2.5-7b: not 28 heads"
[ "$(json_get "$work/qwen.json" config.kv_heads)" = 4 ] || fail "qwen2.5-7b: not 4 KV heads"

# The new workloads run: a shared prefix, conversations, one sample.
$S --shared-prefix 32 --requests 8 --prompt-mean 8 --output-mean 8 --capacity 64 --budget 1MiB \
    --quiet --json --no-compute > "$work/prefix.json" || fail "--shared-prefix 32 was refused"
[ "$(json_get "$work/prefix.json" requests_completed)" = 8 ] || fail "--shared-prefix did not run"
$S --profile conversation --requests 16 --capacity 4096 --quiet --json --no-compute \
    > "$work/conv.json" || fail "--profile conversation was refused"
[ "$(json_get "$work/conv.json" config.workload)" = conversation ] || fail "the workload is not conversation"
$S --samples 1 --requests 4 --prompt-mean 8 --output-mean 8 --capacity 64 --quiet --json \
    --no-compute > "$work/one.json" || fail "--samples 1 was refused"
# --samples 4 forks every prompt: each request completes all four continuations.
$S --samples 4 --requests 4 --prompt-mean 8 --output-mean 8 --capacity 64 --quiet --json \
    --no-compute > "$work/four.json" || fail "--samples 4 was refused"
[ "$(json_get "$work/four.json" requests_completed)" = 4 ] || fail "--samples 4 did not complete"

# A run that completes nothing meets no target.
$S --layers 1000 --no-compute --quiet --json > "$work/none.json" || fail "--layers 1000 failed"
[ "$(json_get "$work/none.json" requests_completed)" = 0 ] || fail "--layers 1000 completed requests"
[ "$(json_get "$work/none.json" targets_met)" = False ] || fail "0 completed yet targets met"
$S --layers 1000 --no-compute --quiet > "$work/none.txt" || fail "--layers 1000 failed"
if grep -q 'targets' "$work/none.txt"; then
    fail "the report still prints the internal targets line: $(grep targets "$work/none.txt")"
fi

# --help documents every option with its default, and exits 0.
$S --help > "$work/help.txt" || fail "simulate --help failed"
for option in --layers --model-width --heads --kv-heads --block-tokens --budget --allow-overcommit \
    --capacity --requests --profile --prompt-mean --output-mean --sigma --arrival --rate \
    --trace --shared-prefix --samples --no-sharing --max-running --update-weights-every --verify \
    --watermark \
    --reserve-tokens --threads --seed --no-compute --audit-every --json --format --plot --quiet \
    --help; do
    grep -q -- "^  $option" "$work/help.txt" || fail "simulate --help lacks $option"
done
[ "$(grep -c 'default' "$work/help.txt")" -ge 20 ] || fail "simulate --help lacks defaults"
$D --help | grep -q -- '--json' || fail "demo --help lacks --json"
$k --help | grep -q -- '--version' || fail "kvpager --help lacks --version"
# Each command's help states the memory a run takes, and the program's help sums them up.
grep -q '^Memory (peak resident set' "$work/help.txt" || fail "simulate --help lacks its memory"
grep -q 'allocator-only run (--no-compute) builds no weights and puts no memory' "$work/help.txt" ||
    fail "simulate --help lacks the allocator-only run's memory"
$D --help | grep -q '^memory: one pool of a few pages' || fail "demo --help lacks its memory"
$k bench --help | grep -q 'peak' || fail "bench --help lacks its memory"
$k --help > "$work/top-help.txt"
for command in simulate demo bench; do
    sed -n '/^memory/,/^options/p' "$work/top-help.txt" | grep -q "^  $command " ||
        fail "kvpager --help gives no memory for $command"
done
# Output that cannot be written is an error too, with its reason.
code=0
$k --help > /dev/full 2> "$work/err" || code=$?
[ "$code" = 2 ] && [ "$(wc -l < "$work/err")" = 1 ] && grep -q "No space left on device" "$work/err" \
    || fail "a full stdout gave exit $code: $(cat "$work/err")"
echo "check_bad_input: $rows bad inputs refused with exit 2 and one line; good inputs ok"
