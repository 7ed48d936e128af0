"""Loop threads for the connector, and its config.

vLLM calls its connector synchronously from the engine's own thread. tiered_kv's
state lives on an asyncio loop in a thread the plug-in owns (``LoopThread``): the
scheduler half runs its TieredKVCache there (scheduler_side.py). ``CacheRuntime``
is the synchronous facade over a whole local TieredKVCache on such a thread, every
call waited for (a process that owns both the tensors and the cache; tests and
tools use it, the vLLM connector does not since the scheduler/worker split).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
from collections import Counter
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from ... import load_config
from ...config import Config
from ...errors import ConfigError, TransferError
from ...layout import KVLayout
from ...loops import new_loop

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
    """An event loop (tiered_kv.loops) on a daemon thread; ``call`` waits for a coroutine, ``submit`` does not."""

    def __init__(self, name: str = "tiered-kv-vllm", device: Any = None) -> None:
        self._loop = new_loop()  # uvloop unless TIERED_KV_UVLOOP=0 (tiered_kv.loops)
        self._device = device
        self._thread = threading.Thread(target=self._run_loop, name=name, daemon=True)
        self._thread.start()

    def _run_loop(self) -> None:
        # The loop thread is ours: its current device must be the KV tensors' (the copy
        # engine's CUDA calls run here), or each call would create a context on GPU 0.
        if self._device is not None and self._device.type == "cuda":
            import torch

            torch.cuda.set_device(self._device)
        self._loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        """Start ``coro`` on the loop; its outcome comes back on the returned future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = CALL_TIMEOUT_S) -> Any:
        """Run ``coro`` on the loop and wait for it, at most ``timeout`` seconds before cancelling it.

        A call that times out is cancelled, and this still waits until the call has
        ended: a cancelled load or store returns only once its copies into or out of
        vLLM's blocks have landed (the cache's contract), and vLLM reuses those blocks
        the moment we return. Then it raises TransferError.
        """
        outcome: concurrent.futures.Future[Any] = concurrent.futures.Future()
        task: list[asyncio.Task] = []

        def start() -> None:
            task.append(self._loop.create_task(coro))
            task[0].add_done_callback(lambda t: _settle(outcome, t))

        self._loop.call_soon_threadsafe(start)
        try:
            return outcome.result(timeout)
        except concurrent.futures.TimeoutError:
            if outcome.done():  # the call itself raised TimeoutError
                raise
        self._loop.call_soon_threadsafe(lambda: task[0].cancel())  # after start: the loop runs callbacks in order
        while True:
            try:
                return outcome.result(timeout)  # it finished between the timeout and the cancel
            except concurrent.futures.CancelledError:
                raise TransferError(f"tiered_kv call timed out after {timeout} s; it was cancelled and its "
                                    "copies have landed") from None  # fmt: skip
            except concurrent.futures.TimeoutError:
                if outcome.done():
                    raise
                if not self._thread.is_alive():
                    raise TransferError("tiered_kv: the cache's loop thread stopped during a call") from None
                log.warning("tiered_kv: a call cancelled after %.0f s is still waiting for its copies", timeout)

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()

    stop = _stop_loop


class CacheRuntime(LoopThread):
    """One TieredKVCache plus the loop thread it lives on."""

    def __init__(self, cfg: Config, layout: KVLayout, *, rank: int = 0, world_size: int = 1) -> None:
        from ... import TieredKVCache

        super().__init__("tiered-kv-vllm", layout.device)
        self._closed = False
        self.counters: Counter[str] = Counter()  # loaded / load_error / stored blocks, for stats and tests

        async def build() -> Any:
            cache = TieredKVCache(cfg, layout, rank=rank, world_size=world_size)
            await cache.start()
            return cache

        try:
            self.cache = self.call(build())
        except BaseException:
            self._stop_loop()
            raise
        self.keyer = self.cache.keyer
        self.key = ""
        self.stats_file: str | None = None  # kv_connector_extra_config.stats_file: final stats, written at close
        close_before_executors_exit(self.close)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Leading keys resident in some tier (being stored does not count); touches them."""

        async def run() -> int:
            hit = self.cache.lookup(keys).total
            if hit:
                self.cache.touch(list(keys[:hit]))  # make the promised blocks the last to go
            return hit

        return self.call(run()) if keys else 0

    def load(self, keys: Sequence[bytes], block_ids: Sequence[int], *, compute: Any = None) -> int:
        """``compute``: an event recorded on the model's stream in vLLM's thread (see ``TieredKVCache.load``)."""
        return self.call(self.cache.load(list(keys), list(block_ids), compute=compute))

    def store(self, keys: Sequence[bytes], block_ids: Sequence[int], prefix: Sequence[bytes] = (), *,
              compute: Any = None) -> Any:  # fmt: skip
        return self.call(self.cache.store(list(keys), list(block_ids), prefix=list(prefix), compute=compute))

    def stats(self) -> dict[str, Any]:
        async def run() -> dict[str, Any]:
            return self.cache.stats()

        return self.call(run())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.stats_file:
            self._write_stats(self.stats_file)
        with _RUNTIMES_LOCK:
            if _RUNTIMES.get(self.key) is self:
                del _RUNTIMES[self.key]
        try:
            self.call(self.cache.aclose())
        except Exception:  # closing must never take the engine down with it
            log.exception("tiered_kv: closing the cache failed")
        finally:
            self._stop_loop()

    def _write_stats(self, path: str) -> None:
        try:
            report = {"counters": dict(self.counters), "stats": self.stats()}
            Path(path).write_text(json.dumps(report, default=str))
        except Exception:  # a report is not worth failing a shutdown for
            log.exception("tiered_kv: writing stats to %s failed", path)



def _settle(outcome: concurrent.futures.Future, task: asyncio.Task) -> None:
    if task.cancelled():
        outcome.cancel()
    elif task.exception() is not None:
        outcome.set_exception(task.exception())
    else:
        outcome.set_result(task.result())


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
    """Register a runtime (or the connector's scheduler half) under its engine id, for in-process readers."""
    runtime.key = key
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
