"""Applies tests/vllm/dsv4_workarounds.py in Python processes started with this directory on PYTHONPATH
and TIERED_KV_DSV4_WORKAROUNDS set to a workaround set's name (vLLM's EngineCore and worker processes under
engine_proc.py's "dsv4_workarounds" / "mla_prefix_cache" spec flags). Any other process: nothing."""

import os
import sys

WHICH = os.environ.get("TIERED_KV_DSV4_WORKAROUNDS", "")
if WHICH:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        import dsv4_workarounds

        dsv4_workarounds.install("dsv4" if WHICH == "1" else WHICH)
    finally:
        del sys.path[0]
