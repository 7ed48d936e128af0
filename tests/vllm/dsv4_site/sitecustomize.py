"""Applies tests/vllm/dsv4_workarounds.py in Python processes started with this directory on PYTHONPATH
and TIERED_KV_DSV4_WORKAROUNDS=1 (vLLM's EngineCore and worker processes under engine_proc.py's
"dsv4_workarounds" spec flag). Any other process: nothing."""

import os
import sys

if os.environ.get("TIERED_KV_DSV4_WORKAROUNDS") == "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        import dsv4_workarounds

        dsv4_workarounds.install()
    finally:
        del sys.path[0]
