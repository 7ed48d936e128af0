"""A TieredKVCache started on a LoopThread (tiered_kv.loops) and called from the test's own thread, the
way the vLLM connector's scheduler half calls its cache from vLLM's thread."""

from __future__ import annotations

from collections.abc import Sequence

import tiered_kv as tkv
from tiered_kv.loops import LoopThread


class CacheThread(LoopThread):
    """``call`` runs a coroutine on the cache's loop and waits for it (``LoopThread.call``)."""

    def __init__(self, cfg: tkv.Config | dict, layout: tkv.KVLayout) -> None:
        super().__init__("tiered-kv-test", layout.device)  # a CUDA layout's device is the loop thread's

        async def build() -> tkv.TieredKVCache:
            cache = tkv.TieredKVCache(tkv.load_config(cfg), layout)
            await cache.start()
            return cache

        try:
            self.cache = self.call(build())
        except BaseException:
            self.stop()
            raise
        self.keyer = self.cache.keyer

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Leading keys resident in some tier (being stored does not count)."""

        async def run() -> int:
            return self.cache.lookup(keys).total

        return self.call(run())

    def close(self) -> None:
        try:
            self.call(self.cache.aclose())
        finally:
            self.stop()
