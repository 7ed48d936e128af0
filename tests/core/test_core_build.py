"""The core that runs is the one the run asked for: the sanitizer build under `make test-core-debug`."""

from __future__ import annotations

import os

from tiered_kv.core import core


def test_the_debug_target_runs_the_sanitizer_build() -> None:
    expect_debug = os.environ.get("TIERED_KV_EXPECT_DEBUG_CORE") == "1"
    assert core.DEBUG is expect_debug, f"core.DEBUG is {core.DEBUG} from {core.__file__}"
