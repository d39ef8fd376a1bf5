#!/bin/sh
# run.sh BUILD_DIR SOURCE_DIR
# Installs the build into a scratch prefix, extracts the README's API tour,
# and builds and runs it twice against the installed package: through
# find_package(kvpager) and through pkg-config (kvpager.pc).
set -eu
build_dir=$1
source_dir=$2
work=$build_dir/package-test
rm -rf "$work"
mkdir -p "$work"
cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null

tour=$work/api_tour.c
awk '/<!-- api-tour -->/ {armed = 1; next}
     armed && /^```c$/ {inside = 1; next}
     inside && /^```$/ {exit}
     inside {print}' "$source_dir/README.md" > "$tour"
if [ ! -s "$tour" ]; then
    echo "package test: README.md has no api-tour C block" >&2
    exit 1
fi

cmake -S "$source_dir/tests/package" -B "$work/cmake" -G Ninja \
      -DCMAKE_PREFIX_PATH="$work/prefix" -DAPI_TOUR="$tour" >/dev/null
cmake --build "$work/cmake" >/dev/null
echo "== find_package(kvpager) build"
"$work/cmake/api_tour"

pc=$(find "$work/prefix" -name kvpager.pc | head -n 1)
libdir=$(PKG_CONFIG_PATH=$(dirname "$pc") pkg-config --variable=libdir kvpager)
cc -std=c11 -Wall -Wextra -Werror $(PKG_CONFIG_PATH=$(dirname "$pc") pkg-config --cflags kvpager) \
   "$tour" $(PKG_CONFIG_PATH=$(dirname "$pc") pkg-config --libs kvpager) \
   -lm -Wl,-rpath,"$libdir" -o "$work/api_tour_pc"
echo "== pkg-config build"
"$work/api_tour_pc"
