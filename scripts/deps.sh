# deps.sh: sourced by the scripts in this folder. Installs the Debian packages
# kvpager needs when any is missing (as root, with apt-get install -y), and
# otherwise says what is missing and stops.
# Two lists: kvp_program_packages builds the library and the kvpager program
# (the compiler, CMake, Ninja, pkg-config, jemalloc, libsodium: the keyed
# BLAKE2b of the prefix index's keys and each pool's random secret,
# docs/DESIGN.md, Threat model; libhiredis-dev: the Redis store's client,
# docs/DESIGN.md, The Redis store; python3-dev and python3-numpy: the Python
# module, which the program preset builds too, so that the README's install
# gives `import kvpager`); scripts/simulate.sh installs only those.
# kvp_test_packages adds what the tests need: cmocka, Valgrind (memcheck,
# helgrind and <valgrind/memcheck.h>), python3, clang-14 and
# libclang-rt-14-dev (libFuzzer and clang's sanitizer runtimes, only
# recommended by clang-14) for the fuzz target (tests/fuzz/), abigail-tools
# (abidw, abidiff) for the ABI check against its committed baseline
# (scripts/abi-update.sh), redis-server for the server each Redis test starts
# on its own loopback port; python3-pytest tests the Python module
# (src/python/, docs/python.md; without python3-dev and python3-numpy CMake
# skips the module); python3-pip, python3-setuptools, python3-wheel
# and python3-venv for `pip install .` offline (ctest python.pip_install).
# python3-torch is not installed here (libtorch
# and its dependencies are ~180 MB): the torch example runs when it imports,
# and ctest reports it skipped otherwise. kvp_packages, what kvp_install_deps installs, is
# both unless a script narrows it.
kvp_program_packages="build-essential cmake ninja-build pkg-config libjemalloc-dev libsodium-dev libhiredis-dev python3-dev python3-numpy"
kvp_test_packages="libcmocka-dev valgrind python3 clang-14 libclang-rt-14-dev abigail-tools redis-server python3-dev python3-numpy python3-pytest python3-pip python3-setuptools python3-wheel python3-venv"
kvp_packages="$kvp_program_packages $kvp_test_packages"

kvp_missing_packages() {
    for package in $kvp_packages; do
        if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
            printf '%s ' "$package"
        fi
    done
}

kvp_install_deps() {
    missing=$(kvp_missing_packages)
    if [ -z "$missing" ]; then
        return 0
    fi
    if [ "$(id -u)" -ne 0 ]; then
        echo "kvpager needs these Debian packages: $missing" >&2
        echo "run this script as root, or: sudo apt-get install -y $missing" >&2
        exit 1
    fi
    echo "installing: $missing"
    export DEBIAN_FRONTEND=noninteractive
    # A fresh machine may have no package lists yet.
    apt-get install -y $missing || { apt-get update && apt-get install -y $missing; }
}
