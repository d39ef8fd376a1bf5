"""src/python/pip_build.py: what `pip install .` runs (the top-level setup.py
calls setup_kvpager): setuptools metadata for the kvpager package and a
build_ext that builds the _kvpager extension with CMake instead of compiling
it itself.

Owns: the pip route only; CMake (src/python/CMakeLists.txt) stays the one
description of the build. The CMake build directory is <build_temp>/cmake,
configured like the `program` preset (Release, no tests, warnings not fatal)
with KVP_PYTHON=ON, this interpreter, and KVP_PYTHON_RPATH=$ORIGIN; only the
target kvpager_python (and libkvpager, which it links) is built. The wheel's
kvpager/ holds __init__.py, __init__.pyi, py.typed, the extension and
libkvpager.so.<soname version> (the extension's NEEDED entry).
Callers: setup.py at the repository's top.
"""
import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def project_version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        return re.search(r"project\(kvpager VERSION ([0-9.]+)", f.read()).group(1)


class CMakeBuildExt(build_ext):
    """Builds every extension of the package (one: kvpager._kvpager) with CMake."""

    def build_extension(self, ext):
        build = os.path.abspath(os.path.join(self.build_temp, "cmake"))
        configure = ["cmake", "-S", ROOT, "-B", build,
                     "-DCMAKE_BUILD_TYPE=Release", "-DKVP_BUILD_TESTS=OFF",
                     "-DKVP_MEMCHECK=OFF", "-DKVP_WERROR=OFF", "-DKVP_PYTHON=ON",
                     "-DPython3_EXECUTABLE=" + sys.executable, "-DKVP_PYTHON_RPATH=$ORIGIN"]
        if not os.path.exists(os.path.join(build, "CMakeCache.txt")) and shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        subprocess.check_call(configure)
        subprocess.check_call(["cmake", "--build", build, "--target", "kvpager_python",
                               "--parallel", str(os.cpu_count() or 1)])
        built = glob.glob(os.path.join(build, "python", "kvpager", "_kvpager*.so"))
        if len(built) != 1:
            raise RuntimeError("kvpager: CMake built %r, not one _kvpager module" % built)
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(built[0], target)
        # the shared library under its soname: the one libkvpager.so.X.Y that is a
        # symlink (to libkvpager.so.X.Y.Z) in the build tree
        sonames = [p for p in glob.glob(os.path.join(build, "libkvpager.so.*"))
                   if os.path.islink(p)]
        if len(sonames) != 1:
            raise RuntimeError("kvpager: not one libkvpager.so.X.Y symlink in %s: %r"
                               % (build, sonames))
        shutil.copyfile(os.path.realpath(sonames[0]),
                        os.path.join(os.path.dirname(target), os.path.basename(sonames[0])))


def setup_kvpager():
    os.makedirs(os.path.join(ROOT, "build", "pip-egg"), exist_ok=True)
    setup(
        name="kvpager",
        version=project_version(),
        description="Paged KV caches for transformer attention under one memory budget "
                    "(Python bindings of libkvpager)",
        license="see the repository",
        python_requires=">=3.8",
        # numpy: Debian's python3-numpy, as for the CMake build (no install_requires:
        # an offline --target install would try to fetch it)
        packages=["kvpager"],
        package_dir={"kvpager": os.path.relpath(os.path.join(ROOT, "src", "python", "kvpager"),
                                                os.getcwd())},
        package_data={"kvpager": ["__init__.pyi", "py.typed"]},
        ext_modules=[Extension("kvpager._kvpager", sources=[])],
        cmdclass={"build_ext": CMakeBuildExt},
        options={"egg_info": {"egg_base": os.path.relpath(os.path.join(ROOT, "build", "pip-egg"),
                                                          os.getcwd())}},
        zip_safe=False,
    )
