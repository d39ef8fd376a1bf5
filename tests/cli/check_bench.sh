#!/bin/sh
# check_bench.sh WORKDIR COMMAND...
# `kvpager bench` end to end, on a grid shrunk to seconds (--lens 64, a
# 16 MiB read array, 4 simulated requests): the --json object has exactly
# the documented keys, every figure is positive and finite, no shape this
# small gets a "% of read" (none is DRAM-resident) but each 1-thread row is
# compared with a read of its own size (percent_of_size_read is 100 * gbps /
# that read), the paged and contiguous gathers agree bit for bit, shapes
# over --max-bytes are listed as skipped, and --plot writes an SVG with the
# read figure dashed.
# Then bad flags: exit 2, one line on stderr naming the flag and the value,
# nothing on stdout, no plot file. The speeds themselves are reported, never
# asserted (the machine is shared).
set -u
work=$1
shift
rm -rf "$work"
mkdir -p "$work" || exit 1
fail() { echo "check_bench: $*" >&2; exit 1; }
. "$(dirname "$0")/refusal.sh"

small="--quick --lens 64 --read-bytes 16MiB --requests 4 --repetitions 3"
# shellcheck disable=SC2086
"$@" bench $small --blocks 16,64 --max-bytes 4MiB --json --plot "$work/bench.svg" > "$work/bench.json" \
    2> "$work/err" || fail "bench --json failed: $(cat "$work/err")"
[ ! -s "$work/err" ] || fail "stderr not empty: $(cat "$work/err")"
python3 - "$work/bench.json" "$work/bench.svg" <<'PY' || fail "bad --json output"
import json, math, sys
out = json.load(open(sys.argv[1]))
top = {"isa", "repetitions", "read_bytes", "read_gbps", "read_gbps_2_threads", "max_bytes",
       "read_huge_pages_advised", "read_kernel", "dram_bytes",
       "gather", "skipped", "page_ops", "simulate", "two_threads", "not_available"}
row_keys = {"dtype", "accum", "block_tokens", "batch", "heads", "kv_heads", "head_width", "len",
            "threads", "kv_bytes", "paged_ns", "contiguous_ns", "gbps", "dram", "read_gbps",
            "read_kernel", "percent_of_read", "percent_of_size_read", "identical"}
page_keys = {"page_bytes", "kvpager_ns", "jemalloc_ns", "glibc_ns", "batch64_kvpager_ns",
             "batch64_jemalloc_ns", "batch64_glibc_ns"}
sim_keys = {"requests", "threads", "tokens_per_second", "bytes_per_token",
            "bound_tokens_per_second", "steps", "mean_step_bytes"}
assert set(out) == top, sorted(set(out) ^ top)
def positive(x, what):
    assert isinstance(x, (int, float)) and not isinstance(x, bool), (what, x)
    assert math.isfinite(x) and x > 0, (what, x)
for key in ("read_gbps", "read_gbps_2_threads"):
    positive(out[key], key)
assert out["read_bytes"] == 16 << 20 and out["max_bytes"] == 4 << 20 and out["repetitions"] == 3
assert out["dram_bytes"] == 256 << 20 and isinstance(out["read_huge_pages_advised"], bool), out
# --quick at L = 64: every dtype at the exact level, the narrow ones at the fast level too;
# 32 query heads over 32 and 8 KV heads (groups 1 and 4), B in {1, 8}, d_h 128,
# block_tokens 16 and 64 (given). Shapes over the 4 MiB cap are skipped and said so.
rows = out["gather"]
# The dtypes come from bench.c's table: f64, f32 and bf16 first, any later one after them.
size = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "fp8_e4m3": 1}
dtypes = []
for r in rows + out["skipped"]:
    if r["dtype"] not in dtypes:
        dtypes.append(r["dtype"])
assert dtypes[:3] == ["f64", "f32", "bf16"] and set(dtypes) <= set(size), dtypes
kinds = [(d, a) for d in dtypes for a in ("exact", "fast") if a == "exact" or d != "f64"]
def kv_bytes(d, b, kv):
    return 2 * size[d] * b * kv * 64 * 128
grid = [(d, a, b, kv) for d, a in kinds for kv in (32, 8) for b in (1, 8)]
cells = [c for c in grid if kv_bytes(c[0], c[2], c[3]) <= 4 << 20]
skips = [c for c in grid if kv_bytes(c[0], c[2], c[3]) > 4 << 20]
# Each (cell, block) twice: on 1 thread, then on a decoder of 2.
assert len(rows) == 4 * len(cells), len(rows)
assert [(r["dtype"], r["accum"], r["batch"], r["kv_heads"]) for r in rows[0::4]] == cells
for cell in cells:
    assert sorted((r["block_tokens"], r["threads"]) for r in rows
                  if (r["dtype"], r["accum"], r["batch"], r["kv_heads"]) == cell) == \
        [(16, 1), (16, 2), (64, 1), (64, 2)], cell
timed = ("threads", "paged_ns", "contiguous_ns", "gbps", "read_gbps", "read_kernel",
         "percent_of_read", "percent_of_size_read")
for one, two in zip(rows[0::2], rows[1::2]):
    assert (one["threads"], two["threads"]) == (1, 2), (one, two)
    assert {k: v for k, v in one.items() if k not in timed} == \
        {k: v for k, v in two.items() if k not in timed}, (one, two)
for r in rows:
    assert set(r) == row_keys, sorted(set(r) ^ row_keys)
    assert (r["heads"], r["head_width"], r["len"]) == (32, 128, 64), r
    assert r["kv_bytes"] == kv_bytes(r["dtype"], r["batch"], r["kv_heads"]), r
    for key in ("paged_ns", "contiguous_ns", "gbps"):
        positive(r[key], key)
    assert abs(r["gbps"] - r["kv_bytes"] / r["paged_ns"]) <= 1e-9 * r["gbps"], r
    # Nothing here is DRAM-resident: no "% of read"; a same-size read on 1 thread only.
    assert r["dram"] is False and r["percent_of_read"] is None, r
    if r["threads"] == 1:
        positive(r["read_gbps"], "read_gbps")
        assert r["read_kernel"] != "", r
        expect = 100.0 * r["gbps"] / r["read_gbps"]
        assert abs(r["percent_of_size_read"] - expect) <= 1e-9 * expect, (r, expect)
    else:
        assert r["read_gbps"] is None and r["percent_of_size_read"] is None, r
    assert r["identical"] is True, r
skipped = out["skipped"]
assert [(s["dtype"], s["accum"], s["batch"], s["kv_heads"], s["len"], s["kv_bytes"])
        for s in skipped] == [(d, a, b, kv, 64, kv_bytes(d, b, kv)) for d, a, b, kv in skips], \
    skipped
pages = out["page_ops"]
assert set(pages) == page_keys, sorted(set(pages) ^ page_keys)
assert pages["page_bytes"] == 2 * 16 * 64 * 8, pages
for key in page_keys:
    positive(pages[key], key)
sim = out["simulate"]
assert set(sim) == sim_keys, sorted(set(sim) ^ sim_keys)
assert sim["requests"] == 4 and sim["threads"] >= 1, sim
for key in sim_keys:
    positive(sim[key], key)
assert out["not_available"] == [], out["not_available"]
two = out["two_threads"]
assert set(two) == {"speedup", "rows", "batch8_speedup", "batch8_rows",
                    "batch1_len2048_speedup", "batch1_len2048_rows"}, sorted(two)
# The median is the upper middle of the sorted ratios (src/cli/measure.c).
def median(xs):
    return sorted(xs)[len(xs) // 2]
ratios = [a["paged_ns"] / b["paged_ns"] for a, b in zip(rows[0::2], rows[1::2])]
assert two["rows"] == len(ratios) and two["speedup"] == median(ratios), two
eight = [a["paged_ns"] / b["paged_ns"] for a, b in zip(rows[0::2], rows[1::2]) if a["batch"] == 8]
assert two["batch8_rows"] == len(eight) and two["batch8_speedup"] == median(eight), two
assert two["batch1_len2048_rows"] == 0, two  # L = 64 only
svg = open(sys.argv[2]).read()
assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>"), "not a whole SVG"
assert 'stroke-dasharray' in svg, "no read line"
for d in dtypes:
    assert 'class="dtype-%s"' % d in svg, "no %s line" % d
assert '<text class="tick-x"' in svg and '>64</text>' in svg, "no L tick"
print("check_bench: json ok: %d rows, read %.2f GB/s" % (len(rows), out["read_gbps"]))
PY

# The table names every part.
# shellcheck disable=SC2086
"$@" bench $small > "$work/table.txt" 2> "$work/err" || fail "bench (table) failed"
for part in "read bandwidth" "paged ns" "page acquire + release" "simulate" \
            "2 threads against 1" "bf16 " "f32 " " fast " " exact "; do
    grep -qF -- "$part" "$work/table.txt" || fail "the table lacks '$part'"
done
"$@" bench --help > "$work/help.txt" || fail "bench --help failed"
for option in --quick --json --plot --quiet --lens --blocks --dtypes --accum --groups --max-bytes --read-bytes \
              --repetitions --requests; do
    grep -q -- "^  $option" "$work/help.txt" || fail "bench --help lacks $option"
done
"$@" --help | grep -q '^  bench ' || fail "kvpager --help lacks bench"

# Bad flags: FLAG and VALUE must both appear in the one line; nothing runs.
rows=0
bad() {
    name=$1 flag=$2 value=$3
    shift 3
    rm -f "$work/ran.svg"
    "$@" --plot "$work/ran.svg" > "$work/out" 2> "$work/err" < /dev/null
    code=$?
    expect_refusal "$name" "$flag" "$value"
}
B="$* bench"
bad unknown "unknown option" "'--bogus'" $B --bogus
bad argument "unexpected argument" "'extra'" $B extra
bad lens_zero --lens "'0'" $B --lens 0
bad lens_text --lens "'256,x'" $B --lens 256,x
bad lens_empty_item --lens "'256,,2048'" $B --lens 256,,2048
bad lens_big --lens "'99999999'" $B --lens 99999999
bad blocks_zero --blocks "'0'" $B --blocks 0
bad dtypes_unknown --dtypes "'f64,f99'" $B --dtypes f64,f99
bad dtypes_twice --dtypes "'f32,f32'" $B --dtypes f32,f32
bad dtypes_empty --dtypes "''" $B --dtypes ""
bad accum_unknown --accum "'slow'" $B --accum slow
bad accum_twice --accum "'fast,fast'" $B --accum fast,fast
bad accum_f64_fast --accum "'fast'" $B --dtypes f64 --accum fast
bad groups_three --groups "'3'" $B --groups 3
bad groups_zero --groups "'0'" $B --groups 0
bad groups_big --groups "'16'" $B --groups 16
bad max_bytes_unit --max-bytes "'2XB'" $B --max-bytes 2XB
bad max_bytes_small --max-bytes "'1KiB'" $B --max-bytes 1KiB
bad max_bytes_default_small --max-bytes "'2GiB'" $B --lens 4194304 --dtypes f64 --accum exact
bad max_bytes_big --max-bytes "'1TiB'" $B --max-bytes 1TiB
bad read_bytes_small --read-bytes "'1KiB'" $B --read-bytes 1KiB
bad read_bytes_big --read-bytes "'1TiB'" $B --read-bytes 1TiB
bad repetitions_zero --repetitions "'0'" $B --repetitions 0
bad repetitions_big --repetitions "'1002'" $B --repetitions 1002
bad requests_zero --requests "'0'" $B --requests 0
bad requests_text --requests "'-3'" $B --requests -3
bad missing_value --lens "'--json'" $B --lens --json
bad twice --repetitions "'3'" $B --repetitions 3 --repetitions 4
# An unwritable --plot is refused before any work (the run would take seconds).
"$@" bench $small --plot "$work/missing/x.svg" > "$work/out" 2> "$work/err"
code=$?
[ "$code" = 2 ] || fail "plot_dir: exit $code, expected 2"
[ "$(wc -l < "$work/err")" = 1 ] || fail "plot_dir: not one line: $(cat "$work/err")"
grep -qF -- "--plot $work/missing/x.svg: No such file or directory" "$work/err" \
    || fail "plot_dir: $(cat "$work/err")"
[ ! -s "$work/out" ] || fail "plot_dir: it ran"
echo "check_bench: ok ($rows bad inputs refused)"
