"""Builds tiered_kv._core, the native bookkeeping core (C++17, pybind11); everything else is in pyproject.toml.

TIERED_KV_CORE_DEBUG=1 builds it with AddressSanitizer and UBSan instead (`make test-core-debug`).
"""

import os

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup
from setuptools.errors import CompileError, ExecError, PlatformError

DEBUG = os.environ.get("TIERED_KV_CORE_DEBUG") == "1"
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"]


class BuildCore(build_ext):
    """build_ext whose failure says what the core needs, instead of only the compiler's last words."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except (CompileError, ExecError, PlatformError, OSError) as e:
            raise CompileError(
                f"tiered_kv: building the native bookkeeping core ({ext.name}) failed: {e}. "
                "It needs a C++17 compiler (g++ >= 9 or clang++ >= 10; on Debian/Ubuntu: "
                "apt-get install g++) and the Python headers (python3-dev); there is no pure-Python fallback."
            ) from e


core = Pybind11Extension(
    "tiered_kv._core",
    ["native/bind.cpp"],
    include_dirs=["native"],
    cxx_std=17,
    depends=[os.path.join("native", f) for f in os.listdir("native") if f.endswith(".hpp")],
    define_macros=[("TKV_DEBUG", "1")] if DEBUG else [],
    extra_compile_args=(["-O1", "-g", "-fno-omit-frame-pointer", *SANITIZE] if DEBUG else ["-O2"]),
    extra_link_args=SANITIZE if DEBUG else [],
)

setup(ext_modules=[core], cmdclass={"build_ext": BuildCore})
