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
echo "== find_package(kvpager): kvpager::kvpager"
"$work/cmake/api_tour_shared"
echo "== find_package(kvpager): kvpager::kvpager_static"
"$work/cmake/api_tour_static"
needs_so() { ldd "$1" | grep -q 'libkvpager\.so'; }
needs_so "$work/cmake/api_tour_shared" || { echo "api_tour_shared does not use libkvpager.so" >&2; exit 1; }
if needs_so "$work/cmake/api_tour_static"; then
    echo "api_tour_static still needs libkvpager.so" >&2
    exit 1
fi

pc_dir=$(dirname "$(find "$work/prefix" -name kvpager.pc | head -n 1)")
pc() { PKG_CONFIG_PATH=$pc_dir pkg-config "$@"; }
libdir=$(pc --variable=libdir kvpager)
# Shared: the consumer needs the library's directory at run time (an rpath,
# as here, or LD_LIBRARY_PATH) unless the prefix is a system one.
cc -std=c11 -Wall -Wextra -Werror $(pc --cflags kvpager) "$tour" $(pc --libs kvpager) \
   -lm -Wl,-rpath,"$libdir" -o "$work/api_tour_pc"
echo "== pkg-config build"
"$work/api_tour_pc"
# Static: -Bstatic picks libkvpager.a; --static adds jemalloc, pthread and libm.
cc -std=c11 -Wall -Wextra -Werror $(pc --cflags kvpager) "$tour" \
   -L"$libdir" -Wl,-Bstatic -lkvpager -Wl,-Bdynamic \
   $(pc --static --libs kvpager | sed 's/-lkvpager//') -o "$work/api_tour_pc_static"
echo "== pkg-config --static build"
"$work/api_tour_pc_static"
if needs_so "$work/api_tour_pc_static"; then
    echo "api_tour_pc_static still needs libkvpager.so" >&2
    exit 1
fi
# The installed program runs from its prefix without LD_LIBRARY_PATH.
"$work/prefix/bin/kvpager" --version
