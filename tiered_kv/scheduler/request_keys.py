"""Block keys for a vLLM request, stable across processes and restarts.

vLLM's own block hashes start from a per-process random seed unless
PYTHONHASHSEED is set, so they cannot name a block on disk across restarts.
We chain tiered_kv's keyer (sha256 or xxh3, never Python's hash) over the
prompt's token ids instead. Whatever else changes a block's KV besides its
tokens (the LoRA adapter, multimodal inputs, ``cache_salt``) is hashed once
into a request salt that is appended to the *first* block's tokens: the chain
carries it into every later key. A salted first block has ``block_size + 4``
values and an unsalted one ``block_size``, so the two can never collide.

Multimodal inputs are folded into the salt whole (identifier and placeholder
position of each): a request with an image shares no block with one without,
even before the image. That loses some hits and never serves wrong KV.

A request that carries prompt embeddings (``enable_prompt_embeds``) is neither
stored nor served: its embedded positions carry placeholder token ids, so two
prompts that differ only in their embeddings would get the same keys.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..keys import BlockKeyer

SALT_WORDS = 4  # 256 bits of sha256, as four int64 words


def request_salt(
    *, lora_name: str | None = None, lora_id: int | None = None, cache_salt: str | None = None,
    mm_items: Sequence[tuple[str, int, int]] = (), lora_path: str | None = None,
) -> tuple[int, ...]:
    """Four int64 words from the request's extra keys; ``()`` when it has none.

    ``mm_items`` holds (identifier, offset, length) per multimodal input.
    """
    extras: dict[str, Any] = {}
    if lora_name is not None or lora_id is not None:
        extras["lora"] = [lora_name, lora_id]
        if lora_path:  # the same name and id may be loaded from another adapter after a restart
            extras["lora_path"] = str(lora_path)
    if cache_salt:
        extras["cache_salt"] = cache_salt
    if mm_items:
        extras["mm"] = [[str(i), int(o), int(n)] for i, o, n in mm_items]
    if not extras:
        return ()
    digest = hashlib.sha256(json.dumps(["tiered-kv-vllm-extras-v1", extras], sort_keys=True).encode()).digest()
    return tuple(int.from_bytes(digest[i : i + 8], "little", signed=True) for i in range(0, 32, 8))


def salt_of(request: Any) -> tuple[int, ...]:
    """The salt of a ``vllm.v1.request.Request`` (duck-typed: only its attributes are read)."""
    lora = getattr(request, "lora_request", None)
    mm = []
    for feature in getattr(request, "mm_features", None) or ():
        pos = feature.mm_position
        mm.append((feature.identifier, pos.offset, pos.length))
    return request_salt(
        lora_name=getattr(lora, "lora_name", None) if lora is not None else None,
        lora_id=getattr(lora, "lora_int_id", None) if lora is not None else None,
        lora_path=getattr(lora, "lora_path", None) if lora is not None else None,
        cache_salt=getattr(request, "cache_salt", None),
        mm_items=mm,
    )


def uses_prompt_embeds(request: Any) -> bool:
    """True when the request carries prompt embeddings (its KV is not named by its token ids alone)."""
    return getattr(request, "prompt_embeds", None) is not None


def request_block_keys(
    keyer: BlockKeyer, token_ids: Sequence[int], block_size: int, salt: Sequence[int] = (), n_blocks: int | None = None
) -> list[bytes]:
    """Keys of the first ``n_blocks`` full blocks (all full blocks when None) of ``token_ids``."""
    full = len(token_ids) // block_size
    n = full if n_blocks is None else min(n_blocks, full)
    keys: list[bytes] = []
    parent: bytes | None = None
    arr = np.asarray(token_ids[: n * block_size], dtype="<i8")
    for b in range(n):
        block = arr[b * block_size : (b + 1) * block_size]
        if b == 0 and salt:
            block = np.concatenate([block, np.asarray(salt, dtype="<i8")])
        parent = keyer.chain(parent, block)
        keys.append(parent)
    return keys


def group_block_keys(keyer: BlockKeyer, keys: Sequence[bytes], group_salt: Sequence[int]) -> list[bytes]:
    """The keys of one KV cache group's blocks: each block key chained with the group's salt (its kind and
    layer names), so groups never share a key; ``()`` (a model with one group) keeps the block keys."""
    if not group_salt:
        return list(keys)
    salt = np.asarray(group_salt, dtype="<i8")
    return [keyer.chain(k, salt) for k in keys]
