#!/usr/bin/env bash
# test.sh: the README's test command. Installs missing Debian packages, then
# builds and runs every test: the ASan+UBSan build, the optimized build, and
# the optimized build again under Valgrind memcheck (with the planted-bug
# gates that prove memcheck can fail).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
kvp_install_deps
cmake --workflow --preset debug
cmake --workflow --preset release
echo "kvpager: every test passed"
