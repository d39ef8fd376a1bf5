#!/bin/sh
# abi-update.sh: the committed ABI baseline of libkvpager.so (abi/libkvpager.abi).
#
#   scripts/abi-update.sh                 rebuild the release library and rewrite the
#                                         baseline from it: run this when a change to
#                                         the public ABI is deliberate, and commit the
#                                         new abi/libkvpager.abi with the change
#   scripts/abi-update.sh --check BUILD   compare BUILD's libkvpager.so with the
#                                         baseline (the test abi.baseline_unchanged
#                                         runs this); fails on ANY difference, even an
#                                         added function
#
# The dump is abidw's (Debian abigail-tools) over the library's DWARF, limited
# to the types of the public headers, without the build's absolute paths, so
# it is the same on every checkout.
set -eu
source_dir=$(cd "$(dirname "$0")/.." && pwd)
baseline=$source_dir/abi/libkvpager.abi

# dump LIBRARY BUILD_DIR OUT: the normalized ABI of LIBRARY.
dump() {
    abidw --no-corpus-path --no-comp-dir-path --no-show-locs --drop-undefined-syms \
          --drop-private-types \
          --headers-dir "$source_dir/include/kvpager" \
          --headers-dir "$2/include/kvpager" \
          "$1" | sed "s|path='$source_dir/|path='|" > "$3"
}

if [ "${1:-}" = "--check" ]; then
    build_dir=$(cd "$2" && pwd)
    fresh=$build_dir/libkvpager.abi
    dump "$build_dir/libkvpager.so" "$build_dir" "$fresh"
    if abidiff --no-show-locs "$baseline" "$fresh"; then
        echo "ABI unchanged: libkvpager.so matches abi/libkvpager.abi"
        exit 0
    fi
    echo "" >&2
    echo "libkvpager.so's ABI differs from the committed baseline abi/libkvpager.abi (above)." >&2
    echo "If the change is deliberate (a new function, a struct grown behind struct_size)," >&2
    echo "regenerate the baseline with the one command" >&2
    echo "    scripts/abi-update.sh" >&2
    echo "and commit abi/libkvpager.abi together with the change." >&2
    exit 1
fi

. "$source_dir/scripts/deps.sh"
kvp_install_deps
cd "$source_dir"
cmake --preset release >/dev/null
cmake --build --preset release --target libkvpager.so
dump "$source_dir/build/release/libkvpager.so" "$source_dir/build/release" "$baseline"
echo "wrote abi/libkvpager.abi from build/release/libkvpager.so; commit it with the change"
