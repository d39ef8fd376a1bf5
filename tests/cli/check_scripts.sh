#!/bin/sh
# check_scripts.sh SOURCE_DIR
# scripts/simulate.sh installs only what the program needs and shows its
# build; the test scripts still install everything (scripts/deps.sh's two
# lists); the program preset it builds configures no tests. Reads the
# scripts only: nothing is installed or built.
set -eu
src=$1
fail() { echo "check_scripts: $*" >&2; exit 1; }
. "$src/scripts/deps.sh"
for tool in clang-14 libclang-rt-14-dev valgrind abigail-tools libcmocka-dev; do
    case " $kvp_program_packages " in *" $tool "*) fail "the program's packages include $tool" ;; esac
    case " $kvp_packages " in *" $tool "*) ;; *) fail "the test packages lack $tool" ;; esac
done
for need in build-essential cmake ninja-build pkg-config libjemalloc-dev libsodium-dev; do
    case " $kvp_program_packages " in *" $need "*) ;; *) fail "the program's packages lack $need" ;; esac
done
grep -q '^kvp_packages=\$kvp_program_packages$' "$src/scripts/simulate.sh" ||
    fail "simulate.sh does not narrow the packages to the program's"
grep -q '^cmake --build --preset program$' "$src/scripts/simulate.sh" ||
    fail "simulate.sh hides its build or builds another preset"
python3 - "$src/CMakePresets.json" <<'PY'
import json, sys
presets = {p["name"]: p for p in json.load(open(sys.argv[1]))["configurePresets"]}
program = presets["program"]["cacheVariables"]
assert program["KVP_BUILD_TESTS"] == "OFF" and program["CMAKE_BUILD_TYPE"] == "Release", program
PY
grep -q 'cmake --install build/program --prefix' "$src/README.md" ||
    fail "the README does not install the build simulate.sh makes"
echo "check_scripts: ok"
