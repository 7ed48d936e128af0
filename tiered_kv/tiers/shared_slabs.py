"""The shared CPU segment as the CPU tier's slab (the scheduler's side of the split)."""

from __future__ import annotations

from .segment_geometry import rank_regions
from .shared_cpu import SharedSegment


class SharedCpuSlabs:
    """The segment as the CPU tier's slab: a drop-in for ``tiers.cpu.CpuSlabs`` (disk, remote, restage).

    ``slab_np`` is the segment's ``[num_slots, storage_ranks, shard_bytes]`` block view: ``slab_np[s]`` is
    slot s's whole block, its stored ranks' pieces in rank order, and fancy indexing on the slot axis copies
    whole blocks. The disk and remote tiers read and write a block as those pieces (one iovec per stored
    rank: one for replicated KV such as MLA, however many TP ranks share it).
    ``regions[r]`` are the group layout's regions as views of their stored rank's sub-slab.
    ``release`` drops the views and detaches from the segment (the last process out removes it).
    """

    pinned = False  # the scheduler's slab is only touched by its own disk and remote I/O
    dma_rows = None

    def __init__(self, segment: SharedSegment, region_block_bytes: tuple[int, ...] | list[int]) -> None:
        import torch

        info = segment.info
        placed = rank_regions(region_block_bytes, info)  # LayoutError unless they tile the ranks' shards
        self.segment = segment
        self.num_slots = info.num_slots
        self.bytes_per_block = info.row_bytes
        self.nbytes = info.num_slots * info.row_bytes
        self.slab_np = segment.blocks
        self.slab = torch.from_numpy(segment.blocks)
        shards = [torch.from_numpy(segment.sub_slab(r)) for r in range(info.storage_ranks)]
        self.offsets = [rank * info.shard_bytes + offset for rank, offset, _ in placed]
        self.regions = [shards[rank][:, offset : offset + width] for rank, offset, width in placed]

    def release(self) -> None:
        """Drop the views and detach from the segment. Idempotent."""
        self.regions = []
        self.slab = self.slab_np = None
        self.segment.close()
