"""Build of the compiled module poslsh._core (pyproject.toml holds the metadata).

Compiler flags: -O3 -fopenmp, C++17, the repository's include/ plus Eigen 3.4 and Spectra.
Environment variables:
  POSLSH_NATIVE=1           add -march=native (off by default: the wheel then runs on any
                            x86-64 machine; on, it is faster but only runs on CPUs like this one)
  POSLSH_EIGEN_INCLUDE      Eigen's include directory (default /usr/include/eigen3)
  POSLSH_SPECTRA_INCLUDE    Spectra's include directory (default /usr/include)
  POSLSH_NO_OPENMP=1        build without OpenMP (kernels single-threaded)
  POSLSH_BUILD_JOBS         sources compiled in parallel (default 2)
"""

import os
import re
from pathlib import Path

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ROOT = Path(__file__).resolve().parent


def version():
    text = (ROOT / "include" / "poslsh" / "version.hpp").read_text()
    parts = [re.search(rf"#define POSLSH_VERSION_{name} (\d+)", text).group(1) for name in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(parts)


def enabled(name):
    return os.environ.get(name, "").strip().lower() in ("1", "on", "true", "yes")


ParallelCompile("POSLSH_BUILD_JOBS", default=2).install()

compile_args = ["-O3"]
link_args = []
if not enabled("POSLSH_NO_OPENMP"):
    compile_args.append("-fopenmp")
    link_args.append("-fopenmp")
if enabled("POSLSH_NATIVE"):
    compile_args.append("-march=native")

sources = sorted(str(path.relative_to(ROOT)) for path in (ROOT / "python" / "src").glob("*.cpp"))

extension = Pybind11Extension(
    "poslsh._core",
    sources,
    include_dirs=[
        str(ROOT / "include"),
        os.environ.get("POSLSH_EIGEN_INCLUDE", "/usr/include/eigen3"),
        os.environ.get("POSLSH_SPECTRA_INCLUDE", "/usr/include"),
    ],
    extra_compile_args=compile_args,
    extra_link_args=link_args,
    cxx_std=17,
)

setup(
    version=version(),
    ext_modules=[extension],
    cmdclass={"build_ext": build_ext},
    # Intermediate files in build-pip/, away from the CMake build directories.
    options={"build": {"build_base": "build-pip"}, "egg_info": {"egg_base": "build-pip"}},
)
