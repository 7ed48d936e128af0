"""What a call hands TieredKVCache, checked before anything is reserved: keys against block ids,
the compute event the copies are ordered after, a session id. ``call_blocks`` and ``store_chain``
are the checks every door of a store or load makes (cache.py on the loop, cache_sync.py off it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from .block_ids import check_block_ids
from .core import core
from .errors import BlockIdError, HintError
from .keys import check_keys
from .transfer.engines.base import Compute, check_compute, compute_event


def check_blocks(
    keys: Sequence[bytes], gpu_block_ids: Sequence[int], key_bytes: int, num_blocks: int
) -> np.ndarray:
    """Keys of ``key_bytes`` each, one GPU block id per key, each below ``num_blocks``: the ids as int64."""
    check_keys(keys, key_bytes)
    ids = core.block_ids(gpu_block_ids, num_blocks)  # one native pass for plain ints
    if ids is None:
        ids = check_block_ids(gpu_block_ids, num_blocks)
    if len(keys) != len(ids):
        raise BlockIdError(f"{len(keys)} keys but {len(ids)} gpu_block_ids")
    return ids


def compute_for(device: torch.device, compute: Compute) -> Compute:
    """A stream becomes an event recorded at the call (CUDA tensors only); anything else is checked."""
    if device.type != "cuda":
        check_compute(compute)
        return None
    return compute_event(compute)


def check_session(session: object) -> str | int:
    if isinstance(session, bool) or not isinstance(session, (str, int)):
        raise HintError(f"session must be a str or int id, got {type(session).__name__}")
    return session


def call_blocks(cache: Any, keys: Sequence[bytes], gpu_block_ids: Sequence[int]) -> np.ndarray:
    """A store's or load's first checks: ``cache`` (a TieredKVCache) is open, and ``check_blocks``."""
    cache.lifecycle.check_open()
    return check_blocks(keys, gpu_block_ids, cache.keyer.key_bytes, cache.layout.num_blocks)


def store_chain(
    cache: Any, keys: Sequence[bytes], prefix: Sequence[bytes], session: object, expect_followup: bool
) -> tuple[list[bytes], list[bytes]]:
    """A store's chain: the prefix's keys checked, the session (if any) hinted with the whole chain;
    (keys, prefix) as lists."""
    if len(prefix):
        check_keys(prefix, cache.keyer.key_bytes)
    keys, prefix = list(keys), list(prefix)
    if session is not None:
        cache.manager.hint(check_session(session), prefix + keys, bool(expect_followup))
    return keys, prefix
