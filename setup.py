"""`pip install .` for the kvpager Python package (docs/python.md, "pip").

The work is in src/python/pip_build.py: CMake builds the _kvpager extension
(target kvpager_python) in the setuptools build directory, and the wheel gets
the package (src/python/kvpager/), the extension and libkvpager's shared
library beside it (the extension's rpath is $ORIGIN). Offline:
    python3 -m pip install . --no-build-isolation --no-index [--target DIR]
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "src", "python"))

from pip_build import setup_kvpager  # noqa: E402

setup_kvpager()
