"""Builds the C++ engine (dcp_datastates._engine). No PyTorch headers, no CUDA toolkit."""
import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

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
