#!/usr/bin/env bash
# simulate.sh: the README's main-job command. Installs missing Debian
# packages, builds the optimized kvpager program, and runs `kvpager simulate`
# on its built-in default workload. Arguments are passed on to simulate.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
kvp_install_deps
cmake --preset release >/dev/null
cmake --build --preset release --target kvpager-cli >/dev/null
exec ./build/release/kvpager simulate "$@"
