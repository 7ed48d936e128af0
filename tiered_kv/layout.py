"""The logical KV layout: the one place ``bytes_per_block`` comes from.

A GPU allocator rounds each KV allocation up (4 KiB in vLLM), so a storage's
*physical* size can exceed its *logical* size. Every view here is bounded by
the logical size; the physical size is only checked to be large enough
(vLLM PR #54021: a quotient over the physical size turned 4 KiB of padding
into 31 bogus regions and the worker held fewer slots than the scheduler).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .errors import LayoutError

_DIGEST_VERSION = "tkv-layout-v1"


def plan_regions(storage_nbytes: int, logical_nbytes: int, num_blocks: int, block_bytes: int) -> int:
    """Number of ``[num_blocks, block_bytes]`` regions in a storage's logical bytes.

    Pure integer arithmetic. Trailing physical padding is ignored whatever its
    size; a logical size that is not a whole number of regions, or a physical
    size below the logical one, raises LayoutError naming both numbers.
    """
    for name, value in (
        ("storage_nbytes", storage_nbytes),
        ("logical_nbytes", logical_nbytes),
        ("num_blocks", num_blocks),
        ("block_bytes", block_bytes),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise LayoutError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if value <= 0:
            raise LayoutError(f"{name} must be positive, got {value}")
    if storage_nbytes < logical_nbytes:
        raise LayoutError(
            f"physical storage of {storage_nbytes} bytes is smaller than its logical size of "
            f"{logical_nbytes} bytes"
        )
    region_bytes = num_blocks * block_bytes
    regions, remainder = divmod(logical_nbytes, region_bytes)
    if remainder or regions == 0:
        raise LayoutError(
            f"logical size {logical_nbytes} bytes is not a whole number of regions of "
            f"num_blocks * block_bytes = {num_blocks} * {block_bytes} = {region_bytes} bytes "
            f"(remainder {remainder})"
        )
    return regions


@dataclass(frozen=True)
class StorageSpec:
    """One KV storage seen by the scheduler: its logical bytes and per-block bytes."""

    logical_nbytes: int
    block_bytes: int
    physical_nbytes: int | None = None  # None: the scheduler side, no padding known

    def regions(self, num_blocks: int) -> int:
        physical = self.logical_nbytes if self.physical_nbytes is None else self.physical_nbytes
        return plan_regions(physical, self.logical_nbytes, num_blocks, self.block_bytes)


@dataclass(frozen=True)
class KVLayout:
    """Geometry of every KV storage; optionally bound to real tensors.

    ``region_block_bytes[i]`` is the bytes one block occupies in region i; a
    block's full size is their sum, ``bytes_per_block``. ``regions`` holds
    uint8 views ``[num_blocks, block_bytes]`` when bound to tensors.
    """

    num_blocks: int
    storages: tuple[StorageSpec, ...]
    region_block_bytes: tuple[int, ...]
    regions: tuple[torch.Tensor, ...] = field(default=(), compare=False, repr=False)

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_specs(cls, specs: Sequence[StorageSpec], num_blocks: int) -> KVLayout:
        """The scheduler-side layout: sizes only, no tensors."""
        if not specs:
            raise LayoutError("a KV layout needs at least one storage")
        region_bytes: list[int] = []
        for spec in specs:
            region_bytes += [spec.block_bytes] * spec.regions(num_blocks)
        return cls(num_blocks, tuple(specs), tuple(region_bytes))

    @classmethod
    def from_block_bytes(cls, region_block_bytes: Sequence[int], num_blocks: int) -> KVLayout:
        """One storage per region (e.g. per-layer K and V tensors), e.g. from a model config."""
        specs = [StorageSpec(num_blocks * b, b) for b in region_block_bytes]
        return cls.from_specs(specs, num_blocks)

    @classmethod
    def from_tensors(
        cls,
        kv_caches: Mapping[str, torch.Tensor],
        num_blocks: int,
        logical_sizes: Sequence[int] | Mapping[str, int] | None = None,
    ) -> KVLayout:
        """Register real KV tensors, each storage once, viewed over its logical bytes.

        ``logical_sizes`` are the scheduler's per-storage byte sizes, in order of
        first appearance (a sequence) or by the name of any tensor on that
        storage (a mapping). Without them the logical extent is what the views
        cover, never ``untyped_storage().nbytes()``.
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise LayoutError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not kv_caches:
            raise LayoutError("kv_caches is empty")
        groups = _group_by_storage(kv_caches, num_blocks)
        if isinstance(logical_sizes, Sequence) and len(logical_sizes) != len(groups):
            raise LayoutError(
                f"logical_sizes has {len(logical_sizes)} entries but the tensors use {len(groups)} distinct storages"
            )
        specs: list[StorageSpec] = []
        views: list[torch.Tensor] = []
        for i, group in enumerate(groups):
            logical = _logical_size(group, i, logical_sizes)
            spec = StorageSpec(logical, group.block_bytes, group.storage.nbytes())
            n_regions = spec.regions(num_blocks)
            if group.extent > logical:
                raise LayoutError(
                    f"tensor {group.names[0]!r} reaches byte {group.extent} of its storage, past the logical "
                    f"size {logical}"
                )
            flat = torch.empty(0, dtype=torch.uint8, device=group.device)
            # The view covers exactly the logical bytes: padding is never a region.
            flat.set_(group.storage, 0, (logical,), (1,))
            views += list(flat.view(n_regions, num_blocks, group.block_bytes).unbind(0))
            specs.append(spec)
        region_bytes = tuple(v.shape[1] for v in views)
        return cls(num_blocks, tuple(specs), region_bytes, tuple(views))

    def bind(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        logical_sizes: Sequence[int] | Mapping[str, int] | None = None,
    ) -> KVLayout:
        """Bind this scheduler-side layout to real tensors; they must agree exactly."""
        bound = KVLayout.from_tensors(kv_caches, self.num_blocks, logical_sizes)
        if bound.bytes_per_block != self.bytes_per_block or bound.digest != self.digest:
            raise LayoutError(
                f"tensors give bytes_per_block={bound.bytes_per_block} (digest {bound.digest}) but the "
                f"scheduler planned bytes_per_block={self.bytes_per_block} (digest {self.digest})"
            )
        return bound

    # -- the numbers --------------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        return sum(self.region_block_bytes)

    @property
    def num_regions(self) -> int:
        return len(self.region_block_bytes)

    @property
    def is_bound(self) -> bool:
        return bool(self.regions)

    @property
    def device(self) -> torch.device:
        return self.regions[0].device if self.regions else torch.device("cpu")

    @property
    def digest(self) -> str:
        """Short digest of the per-block geometry (independent of num_blocks)."""
        text = _DIGEST_VERSION + ";" + ",".join(str(b) for b in self.region_block_bytes)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def slots_for(self, capacity_bytes: int) -> int:
        """Slots a tier of ``capacity_bytes`` holds: the scheduler's and the worker's number."""
        if capacity_bytes < 0:
            raise LayoutError(f"capacity must not be negative, got {capacity_bytes}")
        return capacity_bytes // self.bytes_per_block


@dataclass
class _StorageGroup:
    storage: torch.UntypedStorage
    device: torch.device
    block_bytes: int
    names: list[str]
    extent: int  # highest byte any view reaches, from the storage start


def _group_by_storage(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> list[_StorageGroup]:
    groups: dict[tuple[str, int], _StorageGroup] = {}
    for name, tensor in kv_caches.items():
        if not isinstance(tensor, torch.Tensor):
            raise LayoutError(f"kv_caches[{name!r}] is a {type(tensor).__name__}, not a tensor")
        if tensor.dim() == 0 or tensor.shape[0] == 0 or tensor.shape[0] % num_blocks:
            dim0 = tensor.shape[0] if tensor.dim() else 0
            raise LayoutError(
                f"tensor {name!r}: dim 0 is {dim0}, not a whole multiple of num_blocks={num_blocks}"
            )
        if not tensor.is_contiguous():
            raise LayoutError(f"tensor {name!r} is not contiguous; block rows must be dense")
        elem = tensor.element_size()
        block_bytes = tensor.numel() * elem // num_blocks
        offset = tensor.storage_offset() * elem
        region_bytes = num_blocks * block_bytes
        if offset % region_bytes:
            raise LayoutError(
                f"tensor {name!r} starts at byte {offset} of its storage, not on a region boundary "
                f"(num_blocks * block_bytes = {region_bytes})"
            )
        storage = tensor.untyped_storage()
        gkey = (str(tensor.device), storage.data_ptr())
        group = groups.get(gkey)
        if group is None:
            groups[gkey] = _StorageGroup(storage, tensor.device, block_bytes, [name], offset + region_bytes)
            continue
        if group.block_bytes != block_bytes:
            raise LayoutError(
                f"tensors {group.names[0]!r} and {name!r} share a storage but have {group.block_bytes} and "
                f"{block_bytes} bytes per block"
            )
        group.names.append(name)
        group.extent = max(group.extent, offset + region_bytes)
    return list(groups.values())


def _logical_size(group: _StorageGroup, index: int, logical_sizes: Sequence[int] | Mapping[str, int] | None) -> int:
    if logical_sizes is None:
        return group.extent
    if isinstance(logical_sizes, Mapping):
        found = {logical_sizes[n] for n in group.names if n in logical_sizes}
        if not found:
            raise LayoutError(f"logical_sizes has no entry for storage of tensor {group.names[0]!r}")
        if len(found) > 1:
            raise LayoutError(f"logical_sizes disagree for tensors sharing a storage: {sorted(found)}")
        return found.pop()
    return logical_sizes[index]
