#!/bin/sh
# pip_install.sh PYTHON SOURCE SCRATCH: `pip install .` from a copy of the
# source tree (ctest python.pip_install; docs/python.md, "pip"), offline:
# --no-index --no-build-isolation, pip's own configuration ignored (no find-links
# either), so only Debian's python3-pip, python3-setuptools, python3-wheel,
# python3-dev, python3-numpy, cmake and the compiler are used.
#   1. --target SCRATCH/site, then `import kvpager` from there alone: the module
#      and its libkvpager.so.X.Y come from SCRATCH/site/kvpager/, and a layer
#      steps through a cache (the output equals the C reference);
#   2. a venv (--system-site-packages, for numpy and the build tools) with a
#      plain `pip install`, then the same import with the venv's python.
# The copy is built in place (pip builds in the tree): the second install
# reuses the first one's CMake build directory. Exit 77 (ctest: skipped) when
# pip, setuptools or wheel does not import (scripts/deps.sh installs them).
set -eu
python=$1 source=$2 scratch=$3
if ! "$python" -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in ('pip', 'setuptools', 'wheel', 'venv', 'ensurepip')))" 2>/dev/null; then
    echo "pip_install.sh: pip, setuptools, wheel or venv missing (python3-pip, python3-venv)"
    exit 77
fi
rm -rf "$scratch"
mkdir -p "$scratch/src"
tar -C "$source" --exclude=./build --exclude=./.git -cf - . | tar -C "$scratch/src" -xf -
export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
unset PIP_FIND_LINKS PYTHONPATH PYTHONHOME || true
check='
import sys, numpy as np, kvpager
where = sys.argv[1]
assert kvpager.__file__.startswith(where), (kvpager.__file__, where)
libs = {l.split()[-1] for l in open("/proc/self/maps") if "libkvpager" in l}
assert libs and all(p.startswith(where) for p in libs), libs
pool = kvpager.Pool(block_tokens=4, heads=2, head_width=4, budget_bytes=1 << 16)
layer = kvpager.Layer.random(8, 2, 16, seed=1)
cache = layer.cache(pool, capacity=8)
x = np.random.default_rng(0).standard_normal((1, 5, 8))
out = np.concatenate([layer.forward(cache, x[:, t:t + 1]) for t in range(5)], axis=1)
assert np.array_equal(out, layer.reference(x)[0])
pool.audit()
print(kvpager.__file__, sorted(libs))
'
cd "$scratch"
"$python" -m pip install -q --no-index --no-build-isolation --target "$scratch/site" ./src
PYTHONPATH="$scratch/site" "$python" -c "$check" "$scratch/site/kvpager"
"$python" -m venv --system-site-packages "$scratch/venv"
"$scratch/venv/bin/python" -m pip install -q --no-index --no-build-isolation ./src
"$scratch/venv/bin/python" -c "$check" "$scratch/venv/lib"
