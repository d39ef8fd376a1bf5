#!/usr/bin/env bash
# tier_overhead.sh [RUNS] [POLICY]: what a Redis tier costs a run it never
# helps (issue 20's overhead target: >= 0.95x the run without a tier).
#
# Runs `kvpager simulate` (the release build; the default sharegpt
# workload: unique prompts, so the tier can never hit) alternately without a
# tier and with `--tier redis://127.0.0.1:PORT --tier-policy POLICY` (evict,
# the default, or publish), RUNS times each (default 5), against a
# redis-server this script starts on a free loopback port (saving nothing)
# and empties (FLUSHALL) before every tier run, so each sees a fresh Redis.
# Prints each pair's tokens/s, the medians, their ratio and the median of
# the pairs' own ratios (robust when the shared machine's load drifts), the
# tier runs' hit blocks (must be 0) and writes, and both checksums (equal).
# Extra simulate flags go in SIMULATE_FLAGS (both runs) and TIER_FLAGS (the tier run). Not part of the test command:
# it reports a speed, it asserts none.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
policy=${2:-evict}
flags=${SIMULATE_FLAGS:-}
TIER_FLAGS=${TIER_FLAGS:-} # extra flags of the tier runs only (e.g. --tier-loads never)
case $runs in '' | *[!0-9]* | 0) echo "tier_overhead.sh: RUNS must be a positive whole number, got '$runs'" >&2; exit 2 ;; esac
case $policy in evict | publish) ;; *) echo "tier_overhead.sh: POLICY must be evict or publish, got '$policy'" >&2; exit 2 ;; esac
kvpager=build/release/kvpager
[ -x "$kvpager" ] || { cmake --preset release >/dev/null && cmake --build --preset release --target kvpager-cli >/dev/null; }
work=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$work" \
    --daemonize no >"$work/redis.log" 2>&1 &
redis_pid=$!
trap 'kill $redis_pid 2>/dev/null || true; wait $redis_pid 2>/dev/null || true; rm -rf "$work"' EXIT
for _ in $(seq 50); do
    redis-cli -p "$port" ping >/dev/null 2>&1 && break
    sleep 0.1
done
redis-cli -p "$port" ping >/dev/null || { echo "tier_overhead.sh: redis-server did not start" >&2; cat "$work/redis.log" >&2; exit 1; }
head -c 64 /dev/urandom >"$work/secret"

# field FILE KEY [KEY2]: d[KEY] (or d[KEY][KEY2]) of a JSON report
field() { python3 -c 'import json,sys; d=json.load(open(sys.argv[1]))
for k in sys.argv[2:]: d=d[k]
print(d)' "$@"; }

plain_tps=()
tier_tps=()
ratios=()
for i in $(seq "$runs"); do
    # shellcheck disable=SC2086
    "$kvpager" simulate --json --quiet $flags >"$work/plain.json"
    redis-cli -p "$port" flushall >/dev/null
    # shellcheck disable=SC2086
    "$kvpager" simulate --json --quiet $flags --tier "redis://127.0.0.1:$port" \
        --tier-secret-file "$work/secret" --tier-policy "$policy" $TIER_FLAGS >"$work/tier.json"
    p=$(field "$work/plain.json" tokens_per_second)
    t=$(field "$work/tier.json" tokens_per_second)
    hits=$(field "$work/tier.json" tier hit_blocks)
    writes=$(field "$work/tier.json" tier writes)
    pc=$(field "$work/plain.json" output_checksum)
    tc=$(field "$work/tier.json" output_checksum)
    plain_tps+=("$p")
    tier_tps+=("$t")
    ratios+=("$(python3 -c "print($t / $p)")")
    printf 'pair %d: without %.1f tokens/s, with %.1f (%.3fx); tier hit blocks %s, writes %s; checksums %s %s\n' \
        "$i" "$p" "$t" "$(python3 -c "print($t / $p)")" "$hits" "$writes" "$pc" "$tc"
done
python3 - "${plain_tps[*]}" "${tier_tps[*]}" "${ratios[*]}" <<'EOF'
import statistics, sys
plain = [float(x) for x in sys.argv[1].split()]
tier = [float(x) for x in sys.argv[2].split()]
ratios = [float(x) for x in sys.argv[3].split()]
mp, mt = statistics.median(plain), statistics.median(tier)
print(f"median without {mp:.1f} tokens/s, with {mt:.1f}: {mt / mp:.3f}x; "
      f"median of pair ratios {statistics.median(ratios):.3f}x")
EOF
