"""Builds the C++ engine (dcp_datastates._engine). No PyTorch headers, no CUDA toolkit.

``python -m build`` makes the sdist (the package and csrc/, headers included: MANIFEST.in) and a
wheel built from it, which holds the compiled engine and installs without a compiler."""
import glob

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# The .cpp files compile in parallel, one job per CPU (NPY_NUM_BUILD_JOBS=N to choose).
ParallelCompile("NPY_NUM_BUILD_JOBS").install()

engine = Pybind11Extension(
    "dcp_datastates._engine",
    sorted(glob.glob("csrc/*.cpp")),
    include_dirs=["csrc"],
    cxx_std=17,
    extra_compile_args=["-O3", "-pthread", "-fvisibility=hidden"],
    extra_link_args=["-pthread"],
    libraries=["dl"],
)

setup(ext_modules=[engine], cmdclass={"build_ext": build_ext})
