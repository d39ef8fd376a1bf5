#!/usr/bin/env bash
# test.sh: the README's test command. Installs missing Debian packages, then
# builds and runs the tests.
#
# With no argument (the default, and what .ci/run runs): every test. The
# ASan+UBSan build; the ThreadSanitizer build of the threaded programs; the
# optimized build, with the package, example and ABI checks; the optimized
# build again under Valgrind memcheck and helgrind (with the planted-bug gates
# that prove each checker can fail); and the clang libFuzzer targets, which
# replay their regression cases and seeds and then fuzz from a fixed seed (the
# public API 60 s, the scheduler 45 s).
#
# --quick: the debug (ASan+UBSan) preset's unit tests only (CTest label
# `unit`): configure, build, then ctest -L '^unit$'. Not the command-line,
# stress and bench checks, TSan, Valgrind, the release build's package and ABI
# checks, or fuzzing.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
  cat <<'EOF'
usage: scripts/test.sh [--quick | --help]
  (no flag)  every test: the debug preset (ASan+UBSan), tsan (ThreadSanitizer,
             threaded programs), release (optimized; package, example and ABI
             checks; then Valgrind memcheck and helgrind with planted-bug
             gates) and fuzz (clang libFuzzer replay and a fixed-seed run).
             About 8-15 minutes on 2 cores. .ci/run runs this.
  --quick    the debug preset's unit tests only (ctest label `unit`, under
             ASan+UBSan): about a minute on 2 cores once built. Skips the
             command-line, stress and bench checks, TSan, Valgrind, the
             release build and fuzzing.
  --help     this text.
EOF
}

mode=full
if (($# > 1)); then
  echo "test.sh: unexpected argument '$2' (takes at most one flag: --quick or --help)" >&2
  exit 2
fi
case "${1-}" in
  "") mode=full ;;
  --quick) mode=quick ;;
  --help | -h)
    usage
    exit 0
    ;;
  *)
    echo "test.sh: unknown flag '$1' (expected --quick or --help)" >&2
    exit 2
    ;;
esac

. scripts/deps.sh
kvp_install_deps

if [[ $mode == quick ]]; then
  cmake --preset debug
  cmake --build --preset debug
  ctest --test-dir build/debug -L '^unit$' -j 2 --output-on-failure --no-tests=error
  echo "kvpager: the debug preset's unit tests passed (quick: not cli, stress, bench, TSan, Valgrind, release, fuzz)"
  exit 0
fi

cmake --workflow --preset debug
cmake --workflow --preset tsan
cmake --workflow --preset release
cmake --workflow --preset fuzz
echo "kvpager: every test passed"
