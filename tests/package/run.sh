#!/bin/sh
# run.sh BUILD_DIR SOURCE_DIR
# Installs the build into a scratch prefix, extracts the API tour (docs/embedding.md),
# and builds and runs it against the installed package: through
# find_package(kvpager) and through pkg-config (kvpager.pc). Builds README.md's
# C example (under "## In C") as the README shows, with -Wall -Wextra -Werror,
# and checks it prints what the README says. Checks that the
# generated kvpager/version.h is installed and agrees with the package
# version and the library (tests/package/version_check.c), and that the
# soname is libkvpager.so.0.MINOR before 1.0. Then embeds the source tree
# with add_subdirectory (tests/package/embed): kvpager's tests off, warnings
# not fatal, Valgrind requests compiled out; the tour and the probe run.
# Pulls it in with FetchContent (tests/package/fetch) and runs the tour.
# Checks the static link flags (pkg-config --static: jemalloc, pthread, m),
# and that libkvpager.so does not depend on jemalloc: a program that links
# neither dlopen()s it and runs a pool through dlsym (dlopen_probe.c).
set -eu
build_dir=$1
source_dir=$2
work=$build_dir/package-test
rm -rf "$work"
mkdir -p "$work"
cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
version_h=$(find "$work/prefix" -path '*/include/kvpager/version.h' | head -n 1)
if [ -z "$version_h" ]; then
    echo "package test: kvpager/version.h is not installed" >&2
    exit 1
fi

tour=$work/api_tour.c
awk '/<!-- api-tour -->/ {armed = 1; next}
     armed && /^```c$/ {inside = 1; next}
     inside && /^```$/ {exit}
     inside {print}' "$source_dir/docs/embedding.md" > "$tour"
if [ ! -s "$tour" ]; then
    echo "package test: docs/embedding.md has no api-tour C block" >&2
    exit 1
fi

cmake -S "$source_dir/tests/package" -B "$work/cmake" -G Ninja \
      -DCMAKE_PREFIX_PATH="$work/prefix" -DAPI_TOUR="$tour" >/dev/null
cmake --build "$work/cmake" >/dev/null
echo "== find_package(kvpager): kvpager::kvpager"
"$work/cmake/api_tour_shared"
echo "== find_package(kvpager): kvpager::kvpager_static"
"$work/cmake/api_tour_static"
echo "== find_package(kvpager): version.h, library and package version"
"$work/cmake/version_check_shared"
"$work/cmake/version_check_static"
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
# The README's C example ("## In C": the first ```c block after the heading)
# builds as the README shows (cc tiny.c $(pkg-config --cflags --libs kvpager)),
# warnings fatal, and prints what the README says it prints.
readme_c=$work/tiny.c
awk '/^## In C$/ {armed = 1; next}
     armed && /^```c$/ {inside = 1; next}
     inside && /^```$/ {exit}
     inside {print}' "$source_dir/README.md" > "$readme_c"
if [ ! -s "$readme_c" ]; then
    echo "package test: README.md has no C block under '## In C'" >&2
    exit 1
fi
readme_says=$(sed -n 's/.*(it prints `\([^`]*\)`).*/\1/p' "$source_dir/README.md" | head -n 1)
if [ -z "$readme_says" ]; then
    echo "package test: README.md no longer says what its C example prints ('(it prints \`...\`)')" >&2
    exit 1
fi
echo "== README.md's C example: cc -std=c11 -Wall -Wextra -Werror tiny.c \$(pkg-config --cflags --libs kvpager)"
cc -std=c11 -Wall -Wextra -Werror "$readme_c" $(pc --cflags --libs kvpager) \
   -Wl,-rpath,"$libdir" -o "$work/readme_tiny"
readme_out=$("$work/readme_tiny")
echo "$readme_out"
if [ "$readme_out" != "$readme_says" ]; then
    echo "package test: README.md's C example printed '$readme_out', the README says '$readme_says'" >&2
    exit 1
fi

# Static: -Bstatic picks libkvpager.a; --static adds jemalloc, pthread and libm.
static_libs=$(pc --static --libs kvpager)
for flag in -lkvpager -ljemalloc -lsodium -lpthread -lm; do
    case " $static_libs " in
        *" $flag "*) ;;
        *) echo "package test: pkg-config --static --libs lacks $flag: $static_libs" >&2; exit 1 ;;
    esac
done
case " $(pc --libs kvpager) " in
    *jemalloc*) echo "package test: pkg-config --libs (shared) names jemalloc" >&2; exit 1 ;;
esac
echo "== pkg-config --static --libs: $static_libs"
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

# The soname follows the package's SameMinorVersion promise: 0.MINOR before 1.0.
version=$(pc --modversion kvpager)
major=${version%%.*}
minor=${version#*.}
minor=${minor%%.*}
if [ "$major" = 0 ]; then
    want_soname=libkvpager.so.$major.$minor
else
    want_soname=libkvpager.so.$major
fi
soname=$(objdump -p "$libdir/libkvpager.so" | sed -n 's/^ *SONAME *//p')
echo "== soname $soname (version $version)"
if [ "$soname" != "$want_soname" ]; then
    echo "package test: soname $soname, expected $want_soname" >&2
    exit 1
fi

# Embedded: add_subdirectory(kvpager) in a fresh project, as a vendoring
# engine would, with the Valgrind requests compiled out.
echo "== add_subdirectory(kvpager): tests off, KVP_WERROR off, KVP_VALGRIND=OFF"
cmake -S "$source_dir/tests/package/embed" -B "$work/embed" -G Ninja \
      -DKVPAGER_SOURCE_DIR="$source_dir" -DAPI_TOUR="$tour" -DEXPECT_VERSION="$version" \
      -DKVP_VALGRIND=OFF >/dev/null
if grep -q KVPI_VALGRIND "$work/embed/build.ninja"; then
    echo "package test: KVP_VALGRIND=OFF still compiles the Valgrind requests" >&2
    exit 1
fi
cmake --build "$work/embed" >/dev/null
"$work/embed/api_tour_embedded"
"$work/embed/version_check_embedded"

# FetchContent from a local source tree (no network), tests off.
echo "== FetchContent(kvpager): tests off, KVP_WERROR off"
cmake -S "$source_dir/tests/package/fetch" -B "$work/fetch" -G Ninja \
      -DKVPAGER_SOURCE_DIR="$source_dir" -DAPI_TOUR="$tour" -DKVP_VALGRIND=OFF >/dev/null
cmake --build "$work/fetch" >/dev/null
"$work/fetch/api_tour_fetched"

# dlopen from a host that links neither kvpager nor jemalloc. libkvpager.so
# must not need jemalloc: loading jemalloc late fails ("cannot allocate
# memory in static TLS block", its initial-exec TLS).
echo "== dlopen(libkvpager.so) from a program without jemalloc"
if objdump -p "$libdir/libkvpager.so" | grep -q 'NEEDED.*jemalloc'; then
    echo "package test: libkvpager.so depends on jemalloc" >&2
    exit 1
fi
cc -std=c11 -Wall -Wextra -Werror $(pc --cflags kvpager) \
   "$source_dir/tests/package/dlopen_probe.c" -ldl -lm -o "$work/dlopen_probe"
if ldd "$work/dlopen_probe" | grep -q 'jemalloc\|libkvpager'; then
    echo "package test: dlopen_probe links jemalloc or kvpager" >&2
    exit 1
fi
"$work/dlopen_probe" "$libdir/libkvpager.so"
