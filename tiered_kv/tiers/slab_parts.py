"""A CPU slab's blocks as column parts, for I/O that moves whole blocks (disk records, remote values).

A slab is either the CPU tier's ``uint8[rows, bytes_per_block]`` (one part), or the shared segment's
``[rows, storage_ranks, shard]`` block view (tiers/segment_geometry.py: one part per stored rank, each a
contiguous sub-slab). Either way a block's bytes are part 0's row, then part 1's, ...: rank 0 .. N-1 byte
order, the order a record has always had, so the checksum and the record do not depend on the memory layout.
KV replicated across the TP group (MLA) is stored once: its segment has one stored rank, so its records
are one part, one rank's shard, whatever the TP size.
"""

from __future__ import annotations

import numpy as np
import xxhash


class SlabParts:
    """A slab's rows as column parts: the 2-D slab itself, or each rank's ``[rows, shard]`` piece of a
    ``[rows, ranks, shard]`` block view. A record's payload is row r of part 0, then of part 1, ..."""

    def __init__(self, slab: np.ndarray) -> None:
        self.parts = [slab] if slab.ndim == 2 else [slab[:, k, :] for k in range(slab.shape[1])]
        self.widths = [int(p.shape[1]) for p in self.parts]
        # A C-contiguous part is sliced as one flat buffer (no numpy view per row).
        self._flat = [memoryview(p).cast("B") if p.flags.c_contiguous else None for p in self.parts]

    def __len__(self) -> int:
        return len(self.parts)

    def views(self, r: int) -> list[memoryview]:
        """Row ``r``'s payload as one buffer per part."""
        return [f[r * w : (r + 1) * w] if f is not None else memoryview(p[r])
                for p, f, w in zip(self.parts, self._flat, self.widths, strict=True)]  # fmt: skip

    def gather(self, r: int) -> bytes:
        """Row ``r``'s payload as one bytes object (a copy)."""
        return b"".join(self.views(r))


def xxh_parts(bufs: list[memoryview]) -> int:
    """xxh3-64 of the buffers' bytes one after another (streaming gives the one-shot digest)."""
    h = xxhash.xxh3_64()
    for b in bufs:
        h.update(b)
    return h.intdigest()
