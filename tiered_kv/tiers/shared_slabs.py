"""The shared CPU segment's rows as the CPU tier's slab (the scheduler's side of the split)."""

from __future__ import annotations

from ..errors import LayoutError
from .shared_cpu import SharedSegment


class SharedCpuSlabs:
    """The segment's rows as the CPU tier's slab: a drop-in for ``tiers.cpu.CpuSlabs`` (disk, remote, restage).

    ``regions[r]`` are column views of the group layout's regions over whole rows (rank-major).
    ``release`` drops the views and detaches from the segment (the last process out removes it).
    """

    pinned = False  # the scheduler's rows are only touched by its own disk and remote I/O

    def __init__(self, segment: SharedSegment, region_block_bytes: tuple[int, ...] | list[int]) -> None:
        import torch

        info = segment.info
        if sum(region_block_bytes) != info.row_bytes:
            raise LayoutError(f"the layout gives {sum(region_block_bytes)} bytes per block but the segment's rows "
                              f"are {info.world_size} x {info.shard_bytes} = {info.row_bytes} bytes")  # fmt: skip
        self.segment = segment
        self.num_slots = info.num_slots
        self.bytes_per_block = info.row_bytes
        self.nbytes = info.num_slots * info.row_bytes
        self.slab_np = segment.rows
        self.slab = torch.from_numpy(segment.rows)
        self.offsets: list[int] = []
        self.regions: list = []
        offset = 0
        for block_bytes in region_block_bytes:
            self.offsets.append(offset)
            self.regions.append(self.slab[:, offset : offset + block_bytes])
            offset += block_bytes

    def rows(self, first: int, count: int) -> memoryview:
        """Slots ``first .. first + count - 1`` as one writable buffer (for vectored I/O)."""
        return memoryview(self.slab_np[first : first + count]).cast("B")

    def release(self) -> None:
        """Drop the views and detach from the segment. Idempotent."""
        self.regions = []
        self.slab = self.slab_np = None
        self.segment.close()
