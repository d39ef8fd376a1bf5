#!/usr/bin/env bash
# stress.sh: the stress suite at full scale (the test command runs it small).
# Installs missing Debian packages, builds the optimized programs, and runs:
#   stress-concurrent   2 x cores threads, 4 sequences each, 20000 ops each
#   stress-sharing      2 x cores threads, 4 sequences each, 100000 ops each,
#                       60 share / storm / revision-bump phases
#   stress-reset-reuse  100000 reset/replay cycles
#   stress-exhaustion   200 storms of 2 x cores threads over the last pages
#   stress-pool-cycles  100000 pool create/destroy cycles and 10000 with caches
#                       used, on 2 threads, in flat memory (at most 1 MiB growth)
#   stress-soak         2 million scheduler requests submitted, stepped and collected
#                       (allocator-only, sessions and samples on) in flat memory
# Extra arguments go to every program (e.g. --seed 7).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
kvp_install_deps
cmake --preset release >/dev/null
cmake --build --preset release --target stress-concurrent stress-sharing stress-reset-reuse \
    stress-exhaustion stress-pool-cycles stress-soak >/dev/null
status=0
for program in concurrent reset-reuse exhaustion; do
    ./build/release/stress/stress-$program "$@" || status=1
done
./build/release/stress/stress-sharing --ops 100000 --phases 60 "$@" || status=1
./build/release/stress/stress-pool-cycles --threads 2 --cycles 100000 --cache-cycles 10000 "$@" ||
    status=1
./build/release/stress/stress-soak --requests 2000000 "$@" || status=1
exit $status
