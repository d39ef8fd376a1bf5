#!/usr/bin/env bash
# test.sh: the README's test command. Installs missing Debian packages, then
# builds and runs every test: the ASan+UBSan build; the ThreadSanitizer build
# of the threaded programs; the optimized build; and the optimized build again
# under Valgrind memcheck and helgrind (with the planted-bug gates that prove
# each checker can fail); and the clang libFuzzer targets, which replay their
# regression cases and seeds and then fuzz from a fixed seed (the public API
# 60 s, the scheduler 45 s).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
kvp_install_deps
cmake --workflow --preset debug
cmake --workflow --preset tsan
cmake --workflow --preset release
cmake --workflow --preset fuzz
echo "kvpager: every test passed"
