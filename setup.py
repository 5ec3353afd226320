"""Build of the compiled module poslsh._core for `pip install .` (pyproject.toml holds the metadata).

The module has one build definition, python/CMakeLists.txt: build_ext configures this repository
with CMake (the Python module on, the tests, examples and benchmarks off), builds its target
poslsh_python and copies the module into the wheel. CMake (>= 3.25) finds Eigen 3.4, Spectra,
OpenMP, numpy and pybind11 as in any CMake build; the interpreter is the one running pip.

Environment variables:
  POSLSH_NATIVE=1         -DPOSLSH_NATIVE=ON: compile with -march=native (off by default: the
                          wheel then runs on any x86-64 machine; on, it is faster but only runs
                          on CPUs like this one)
  POSLSH_NO_OPENMP=1      -DPOSLSH_USE_OPENMP=OFF: build without OpenMP (kernels single-threaded)
  POSLSH_BUILD_JOBS       parallel compile jobs (default 2)
  CMAKE_ARGS              more CMake options, e.g. -DCMAKE_CXX_COMPILER=clang++
  CMAKE_PREFIX_PATH       (read by CMake) where to look for Eigen3, spectra and pybind11
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def version():
    text = (ROOT / "include" / "poslsh" / "version.hpp").read_text()
    parts = [re.search(rf"#define POSLSH_VERSION_{name} (\d+)", text).group(1) for name in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(parts)


def enabled(name):
    return os.environ.get(name, "").strip().lower() in ("1", "on", "true", "yes")


def on_off(flag):
    return "ON" if flag else "OFF"


class CMakeExtension(Extension):
    """An extension built by a CMake target (no sources of its own here)."""

    def __init__(self, name, target):
        super().__init__(name, sources=[])
        self.target = target


class CMakeBuild(build_ext):
    """Configures the repository with CMake, builds the extension's target, copies the module."""

    def build_extension(self, ext):
        build = Path(self.build_temp).resolve() / "cmake"
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DPOSLSH_BUILD_PYTHON=ON",
            "-DPOSLSH_BUILD_TESTS=OFF",
            "-DPOSLSH_BUILD_EXAMPLES=OFF",
            "-DPOSLSH_BUILD_BENCHMARKS=OFF",
            f"-DPOSLSH_NATIVE={on_off(enabled('POSLSH_NATIVE'))}",
            f"-DPOSLSH_USE_OPENMP={on_off(not enabled('POSLSH_NO_OPENMP'))}",
            f"-DPython_EXECUTABLE={sys.executable}",
            *shlex.split(os.environ.get("CMAKE_ARGS", "")),
        ]
        try:
            import pybind11  # the pybind11 this build uses, if it is importable

            configure.append(f"-Dpybind11_DIR={pybind11.get_cmake_dir()}")
        except ImportError:
            pass
        jobs = os.environ.get("POSLSH_BUILD_JOBS", "2")
        if shutil.which("cmake") is None:
            sys.exit("poslsh: building the module needs CMake >= 3.25 on PATH (Debian: apt-get install cmake)")
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", str(build), "--target", ext.target, "--parallel", jobs], check=True)
        # python/CMakeLists.txt puts the module in <build>/python/poslsh/.
        built = sorted((build / "python" / "poslsh").glob("_core.*"))
        if len(built) != 1:
            sys.exit(f"poslsh: expected one built module _core.* in {build / 'python' / 'poslsh'}, found {built}")
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[0], target)


# Intermediate files in build-pip/ (relative to the source directory, where pip runs this file),
# away from the CMake build directories; egg_info needs its directory to exist.
os.makedirs("build-pip", exist_ok=True)

setup(
    version=version(),
    ext_modules=[CMakeExtension("poslsh._core", target="poslsh_python")],
    cmdclass={"build_ext": CMakeBuild},
    options={"build": {"build_base": "build-pip"}, "egg_info": {"egg_base": "build-pip"}},
)
