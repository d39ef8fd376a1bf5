#!/usr/bin/env bash
# simulate.sh: the README's main-job command. Installs the missing Debian
# packages the program needs (scripts/deps.sh's kvp_program_packages: no test
# tools), builds the optimized kvpager program and libraries (the `program`
# preset: no tests, into build/program, with Ninja's progress shown), and runs
# `kvpager simulate` on its built-in default workload. Arguments are passed on
# to simulate. Afterwards `cmake --install build/program --prefix DIR`
# installs what was built: the program, both libraries, the headers and the
# CMake and pkg-config files.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/deps.sh
kvp_packages=$kvp_program_packages
kvp_install_deps
echo "configuring build/program (cmake --preset program)"
cmake --preset program >/dev/null
echo "building build/program (cmake --build --preset program)"
cmake --build --preset program
exec ./build/program/kvpager simulate "$@"
