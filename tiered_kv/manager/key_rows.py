"""Keys as the manager handles them: one ``uint8[n, key_bytes]`` array per batch, and repeats within it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def key_rows(keys: Sequence[bytes], key_bytes: int) -> np.ndarray:
    """The keys as one ``uint8[n, key_bytes]`` array (keys are validated by the caller)."""
    return np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), key_bytes)


def repeats(keys: Sequence[bytes]) -> np.ndarray | None:
    """True for each key that repeats an earlier one; None when none does (the common case, checked at C speed)."""
    if len(set(keys)) == len(keys):
        return None
    seen: set[bytes] = set()
    mask = np.zeros(len(keys), dtype=bool)
    for i, key in enumerate(keys):
        mask[i] = key in seen
        seen.add(key)
    return mask


def first_repeat(keys: Sequence[bytes]) -> int:
    """Index of the first key that repeats an earlier one, or len(keys)."""
    mask = repeats(keys)
    return len(keys) if mask is None else int(np.argmax(mask))
