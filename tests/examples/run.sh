#!/bin/sh
# run.sh BUILD_DIR SOURCE_DIR
# Installs the build into a scratch prefix and builds examples/ against the
# installed package with find_package(kvpager), as an outside engine would
# (public headers and libkvpager.so only), then runs each example:
# external_kernel must match kvp_attention_forward (it exits nonzero if not).
set -eu
build_dir=$1
source_dir=$2
work=$build_dir/examples-test
rm -rf "$work"
mkdir -p "$work"
cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
cmake -S "$source_dir/examples" -B "$work/cmake" -G Ninja \
      -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/cmake" >/dev/null
ldd "$work/cmake/external_kernel" | grep -q "$work/prefix" ||
    { echo "examples: external_kernel does not use the installed libkvpager.so" >&2; exit 1; }
"$work/cmake/external_kernel"
