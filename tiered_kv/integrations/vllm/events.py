"""KV events for a router: tiered_kv's tier events, told in vLLM's block hashes.

The manager reports (kind, tier, keys); a KV-aware router knows vLLM's block
hashes, not our keys. ``HashBook`` remembers, for each block whose store was
queued, the vLLM hash it had, and which of our tiers hold it; ``translate``
turns a batch of manager events into (stored?, medium, hashes) records that the
connector wraps as vLLM ``BlockStored`` / ``BlockRemoved``. Pure: no vLLM import.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

CPU, DISK = "CPU", "STORAGE"  # vLLM's own medium strings (vllm.v1.kv_offload.base.Medium)

# kind, tier -> (medium the block left, medium the block reached); a spill moves a block CPU -> disk.
_MOVES: dict[tuple[str, str], tuple[str | None, str | None]] = {
    ("stored", "cpu"): (None, CPU),
    ("evicted", "cpu"): (CPU, None),
    ("dropped", "cpu"): (CPU, None),
    ("spilled", "disk"): (CPU, DISK),
    ("dropped", "disk"): (CPU, None),  # the spill failed: the CPU copy was its last
    ("evicted", "disk"): (DISK, None),
}


class HashBook:
    """key -> (vLLM hash, media holding it); bounded: the oldest entries go first past ``cap``."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._book: OrderedDict[bytes, tuple[Any, set[str]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._book)

    def remember(self, keys: Sequence[bytes], hashes: Sequence[Any]) -> None:
        for key, h in zip(keys, hashes, strict=True):
            if key not in self._book:
                self._book[key] = (h, set())
        while len(self._book) > self.cap:
            self._book.popitem(last=False)

    def translate(self, events: Iterable[tuple[str, str, list[bytes]]]) -> list[tuple[bool, str, list[Any]]]:
        """Manager events -> [(stored, medium, vLLM hashes)]; keys never remembered are skipped."""
        out: list[tuple[bool, str, list[Any]]] = []
        for kind, tier, keys in events:
            left, reached = _MOVES.get((kind, tier), (None, None))
            removed: list[Any] = []
            stored: list[Any] = []
            for key in keys:
                entry = self._book.get(key)
                if entry is None:
                    continue
                h, media = entry
                if left is not None and left in media:
                    media.discard(left)
                    removed.append(h)
                if reached is not None and reached not in media:
                    media.add(reached)
                    stored.append(h)
                if not media:  # it left every tier: forget it
                    del self._book[key]
            if removed:
                out.append((False, left, removed))
            if stored:
                out.append((True, reached, stored))
        return out


def to_vllm_events(records: list[tuple[bool, str, list[Any]]], block_size: int) -> list[Any]:
    """Records from ``HashBook.translate`` as vLLM ``BlockStored`` / ``BlockRemoved``."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    out: list[Any] = []
    for stored, medium, hashes in records:
        ext = [maybe_convert_block_hash(h) for h in hashes]
        if stored:
            out.append(BlockStored(block_hashes=ext, parent_block_hash=None, token_ids=[], block_size=block_size,
                                   lora_id=None, medium=medium, lora_name=None))  # fmt: skip
        else:
            out.append(BlockRemoved(block_hashes=ext, medium=medium))
    return out
