"""The event loops tiered_kv itself creates: uvloop when it is importable, asyncio's own otherwise.

Only the loops this package starts come from here: ``tiered-kv replay``, ``tiered-kv bench`` and the
vLLM connector's loop thread. A frontend that embeds TieredKVCache runs it on its own loop, whatever
that is; nothing here installs a policy or touches a loop the caller made.

``TIERED_KV_UVLOOP`` chooses: unset or ``auto`` takes uvloop when importable; ``0``/``off``/``false``/``no``
keeps asyncio's loop; ``1``/``on``/``true``/``yes`` requires uvloop (a ConfigError when it is missing).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any

from .errors import ConfigError

__all__ = ["ENV_VAR", "loop_factory", "new_loop", "run", "uvloop_chosen"]

ENV_VAR = "TIERED_KV_UVLOOP"
_OFF, _ON, _AUTO = {"0", "off", "false", "no"}, {"1", "on", "true", "yes"}, {"", "auto"}


def _uvloop() -> Any:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop


def uvloop_chosen() -> bool:
    """Whether the loops tiered_kv creates use uvloop, from ``TIERED_KV_UVLOOP`` and what is installed."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in _OFF:
        return False
    if value not in _ON | _AUTO:
        raise ConfigError(f"{ENV_VAR}={os.environ[ENV_VAR]!r}: expected auto, 1/on/true/yes or 0/off/false/no")
    if _uvloop() is not None:
        return True
    if value in _ON:
        raise ConfigError(f"{ENV_VAR}={os.environ[ENV_VAR]!r} asks for uvloop, which is not importable "
                          f"(pip install uvloop; it does not exist on Windows)")  # fmt: skip
    return False


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """A no-argument callable that makes a new loop of the chosen kind (for asyncio.Runner and friends)."""
    return _uvloop().new_event_loop if uvloop_chosen() else asyncio.new_event_loop


def new_loop() -> asyncio.AbstractEventLoop:
    """A new loop of the chosen kind, not set as anybody's current loop (for a loop thread)."""
    return loop_factory()()


def run(coro: Coroutine[Any, Any, Any]) -> Any:
    """``asyncio.run(coro)`` on a new loop of the chosen kind."""
    try:
        chosen = uvloop_chosen()
    except ConfigError:
        coro.close()  # never started: close it so it does not warn about never being awaited
        raise
    return _uvloop().run(coro) if chosen else asyncio.run(coro)
