"""The loop thread the scheduler-side cache lives on, and the connector's config.

vLLM calls its connector synchronously from the engine's own thread. The
scheduler half runs its TieredKVCache on an asyncio loop in a thread it owns:
quick calls (a residency lookup, no I/O) are sent there and waited for; stores
and loads are started there and never waited for by vLLM's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

import yaml

from ... import load_config
from ...config import Config
from ...errors import ConfigError

log = logging.getLogger(__name__)

_RUNTIMES: dict[str, Any] = {}
_RUNTIMES_LOCK = threading.Lock()

CALL_TIMEOUT_S = 120.0  # a load or store that takes longer is a fault, reported as one


def resolve_config(raw: Any, model_id: str, revision: str | None, bytes_per_block: int) -> Config:
    """The tiered_kv config from ``kv_connector_extra_config['config']`` (a YAML path or a dict).

    Where the config names no ``model.model_id``, vLLM's model (and revision)
    fill it in, so the key namespace and the disk directory follow the model.
    """
    if isinstance(raw, (str, Path)):
        path = Path(raw).expanduser()
        try:
            data = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"kv_connector_extra_config.config: cannot read {str(path)!r}: {exc}") from None
    elif isinstance(raw, Mapping):
        data = raw
    else:
        raise ConfigError(
            f"kv_connector_extra_config.config must be a YAML path or a dict, got {type(raw).__name__}"
        )
    if not isinstance(data, Mapping):
        raise ConfigError(f"kv_connector_extra_config.config: the top level must be a mapping, got {data!r}")
    data = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in data.items()}
    model = data.setdefault("model", {})
    if not isinstance(model, dict):
        raise ConfigError(f"model: must be a mapping, got {model!r}")
    if "model_id" not in model:
        model["model_id"] = model_id
        if revision and "revision" not in model:
            model["revision"] = revision
    if "bytes_per_block" not in model and not {"num_layers", "num_kv_heads", "head_dim"} & set(model):
        model["bytes_per_block"] = bytes_per_block
    return load_config(data)


class LoopThread:
    """An asyncio loop on a daemon thread; ``call`` waits for a coroutine, ``submit`` does not."""

    def __init__(self, name: str = "tiered-kv-vllm") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = CALL_TIMEOUT_S) -> Any:
        return self.submit(coro).result(timeout)

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()


def close_before_executors_exit(close: Callable[[], None]) -> None:
    """Close (flushing the disk tier) before concurrent.futures stops its executors at exit.

    vLLM may shut the connector down from a finalizer that runs after those
    executors are gone; hooks registered here run before them (last registered,
    first run), so a process that simply exits still leaves a flushed disk tier.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # not CPython: the plain atexit hook is the best there is
        import atexit

        atexit.register(close)
    else:
        register(close)


def publish_runtime(key: str, runtime: Any) -> None:
    """Register a scheduler half under its engine id (tests and the bench read its stats in-process)."""
    with _RUNTIMES_LOCK:
        _RUNTIMES[key] = runtime


def find_runtime(key: str) -> Any:
    with _RUNTIMES_LOCK:
        return _RUNTIMES.get(key)


def unpublish_runtime(key: str, runtime: Any) -> None:
    with _RUNTIMES_LOCK:
        if _RUNTIMES.get(key) is runtime:
            del _RUNTIMES[key]


def all_runtimes() -> list[Any]:
    """Every live runtime in this process (tests and the bench read their stats)."""
    with _RUNTIMES_LOCK:
        return list(_RUNTIMES.values())
