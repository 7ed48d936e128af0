"""Loads tiered_kv._core, the native bookkeeping core (native/*.hpp, built by setup.py on install).

There is no pure-Python fallback: a missing core is an install error that says how to build it.
``TIERED_KV_CORE=/path/to/_core.so`` loads another build of the same module instead (the
sanitizer build that ``make test-core-debug`` runs the differential tests against).
"""

from __future__ import annotations

import importlib.util
import os
import sys

from .errors import BlockIdError, KeyFormatError, SlotError, TieredKVError, TransferError


def _load():
    path = os.environ.get("TIERED_KV_CORE")
    if path:
        spec = importlib.util.spec_from_file_location("tiered_kv._core", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"TIERED_KV_CORE={path!r} is not a loadable extension module")
        module = importlib.util.module_from_spec(spec)
        sys.modules["tiered_kv._core"] = module
        spec.loader.exec_module(module)
        return module
    try:
        from . import _core
    except ImportError as e:
        raise ImportError(
            f"tiered_kv's native bookkeeping core (tiered_kv._core) is not built or does not load ({e}). "
            "Install the package so that setup.py compiles it: `pip install -e .` (or `make venv`), "
            "which needs a C++17 compiler (g++ or clang++) and the Python headers."
        ) from e
    return _core


core = _load()
core.set_errors(TieredKVError, KeyFormatError, SlotError, TransferError, BlockIdError)


def seeds() -> bytes:
    """Per-instance secrets for the core's keyed hashes (callers can craft keys, not guess these)."""
    return os.urandom(32)
