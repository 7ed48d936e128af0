"""Reading the engine's KV tensors: which storage each lives on, where its block dim is.

Split from layout.py so that the arithmetic of regions stays apart from the
inspection of tensors (declarations, storages, ambiguity).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import LayoutError

if TYPE_CHECKING:
    import torch

# An int for every tensor, or a value per tensor name; None: not declared.
Declared = int | Mapping[str, int] | None


@dataclass(frozen=True)
class TensorSpec:
    """One registered KV tensor, without its data: what the layout digest covers."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    block_dim: int
    rows_per_block: int
    storage: int  # index of its storage in the layout
    first_region: int  # index of its first region within that storage

    def digest_part(self) -> list:
        # Independent of num_blocks: the block dim's size and the strides of the dims
        # before it scale with it, so only the per-block part is hashed.
        d = self.block_dim
        return [self.name, self.dtype, list(self.shape[:d]), list(self.shape[d + 1 :]),
                list(self.stride[d + 1 :]), d, self.rows_per_block, self.storage, self.first_region]  # fmt: skip

    def as_list(self) -> list:
        return [self.name, self.dtype, list(self.shape), list(self.stride), self.block_dim,
                self.rows_per_block, self.storage, self.first_region]  # fmt: skip

    @classmethod
    def from_list(cls, item: Sequence) -> TensorSpec:
        name, dtype, shape, stride, block_dim, rows, storage, first = item
        return cls(str(name), str(dtype), tuple(int(x) for x in shape), tuple(int(x) for x in stride),
                   int(block_dim), int(rows), int(storage), int(first))  # fmt: skip


@dataclass
class StorageGroup:
    storage: torch.UntypedStorage
    device: torch.device
    block_bytes: int
    names: list[str]
    regions: set[int]  # region indices the tensors cover
    region_bytes: int  # num_blocks * block_bytes

    @property
    def extent(self) -> int:
        """Bytes from the storage start to the end of the last covered region."""
        return (max(self.regions) + 1) * self.region_bytes


def _declared(value: Declared, name: str, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        value = value.get(name)
        if value is None:
            return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"{what} for tensor {name!r} must be an int, got {value!r}")
    return value


def _check_declared_names(value: Declared, names: Mapping[str, object], what: str) -> None:
    if isinstance(value, Mapping):
        unknown = [n for n in value if n not in names]
        if unknown:
            raise LayoutError(f"{what} names tensors that kv_caches does not have: {unknown}")


def _block_geometry(name: str, tensor: torch.Tensor, num_blocks: int, block_dim: Declared,
                    rows_per_block: Declared) -> tuple[int, int, int, int]:  # fmt: skip
    """(block dim, rows per block, regions in the tensor, bytes per block per region)."""
    shape = tuple(tensor.shape)
    dim, rows = _declared(block_dim, name, "block_dim"), _declared(rows_per_block, name, "rows_per_block")
    declared = dim is not None or rows is not None
    dim = 0 if dim is None else dim
    rows = 1 if rows is None else rows
    if not 0 <= dim < len(shape):
        raise LayoutError(f"tensor {name!r} of shape {list(shape)}: block_dim={dim} is not one of its dims")
    if rows <= 0:
        raise LayoutError(f"tensor {name!r}: rows_per_block must be positive, got {rows}")
    if shape[dim] != num_blocks * rows:
        hint = (
            "" if declared else
            f"; declare how: block_dim={{{name!r}: 1}} for a [2, num_blocks, ...] tensor, or "
            f"rows_per_block={{{name!r}: {shape[0] // num_blocks}}} if consecutive rows of dim 0 make one block"
        )  # fmt: skip
        raise LayoutError(
            f"tensor {name!r} of shape {list(shape)}: dim {dim} is {shape[dim]}, expected num_blocks * rows_per_block "
            f"= {num_blocks} * {rows} = {num_blocks * rows}{hint}"
        )
    if not declared and num_blocks > 1:
        others = [d for d, n in enumerate(shape) if d != dim and n == num_blocks]
        if others:
            raise LayoutError(
                f"tensor {name!r} of shape {list(shape)} is ambiguous: dims {[dim, *others]} all equal "
                f"num_blocks={num_blocks}; declare the block dim, e.g. block_dim={{{name!r}: {dim}}}"
            )
    outer = math.prod(shape[:dim])
    block_bytes = rows * math.prod(shape[dim + 1 :]) * tensor.element_size()
    if block_bytes == 0 or outer == 0:
        raise LayoutError(f"tensor {name!r} of shape {list(shape)} holds no bytes per block")
    return dim, rows, outer, block_bytes


def group_by_storage(kv_caches: Mapping[str, torch.Tensor], num_blocks: int, block_dim: Declared,
                     rows_per_block: Declared) -> tuple[list[StorageGroup], list[TensorSpec]]:  # fmt: skip
    """Group tensors by the storage they live on; each storage's regions are registered once."""
    import torch

    _check_declared_names(block_dim, kv_caches, "block_dim")
    _check_declared_names(rows_per_block, kv_caches, "rows_per_block")
    groups: dict[tuple[str, int], StorageGroup] = {}
    order: list[tuple[str, int]] = []
    specs: list[TensorSpec] = []
    for name, tensor in kv_caches.items():
        if not isinstance(name, str):
            raise LayoutError(f"kv_caches keys must be tensor names (str), got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise LayoutError(f"kv_caches[{name!r}] is a {type(tensor).__name__}, not a tensor")
        if tensor.dim() == 0:
            raise LayoutError(f"tensor {name!r} is a scalar; dim 0 must count blocks")
        if not tensor.is_contiguous():
            raise LayoutError(f"tensor {name!r} is not contiguous; block rows must be dense")
        dim, rows, outer, block_bytes = _block_geometry(name, tensor, num_blocks, block_dim, rows_per_block)
        offset = tensor.storage_offset() * tensor.element_size()
        region_bytes = num_blocks * block_bytes
        if offset % region_bytes:
            raise LayoutError(
                f"tensor {name!r} starts at byte {offset} of its storage, not on a region boundary "
                f"(num_blocks * block_bytes = {region_bytes})"
            )
        first = offset // region_bytes
        storage = tensor.untyped_storage()
        gkey = (str(tensor.device), storage.data_ptr())
        group = groups.get(gkey)
        if group is None:
            group = groups[gkey] = StorageGroup(storage, tensor.device, block_bytes, [], set(), region_bytes)
            order.append(gkey)
        elif group.block_bytes != block_bytes:
            raise LayoutError(
                f"tensors {group.names[0]!r} and {name!r} share a storage but have {group.block_bytes} and "
                f"{block_bytes} bytes per block"
            )
        group.names.append(name)
        group.regions.update(range(first, first + outer))
        dtype = str(tensor.dtype).removeprefix("torch.")
        specs.append(TensorSpec(name, dtype, tuple(tensor.shape), tuple(tensor.stride()), dim, rows,
                                order.index(gkey), first))  # fmt: skip
    for group in groups.values():
        missing = sorted(set(range(max(group.regions) + 1)) - group.regions)
        if missing:
            raise LayoutError(
                f"the storage of tensor {group.names[0]!r} has regions {missing} (of {group.region_bytes} bytes "
                f"each) that no registered tensor covers; register every KV tensor on it"
            )
    return [groups[k] for k in order], specs


def logical_size(group: StorageGroup, index: int, logical_sizes: Sequence[int] | Mapping[str, int] | None) -> int:
    if logical_sizes is None:
        return group.extent
    if isinstance(logical_sizes, Mapping):
        found = {logical_sizes[n] for n in group.names if n in logical_sizes}
        if not found:
            raise LayoutError(f"logical_sizes has no entry for storage of tensor {group.names[0]!r}")
        if len(found) > 1:
            raise LayoutError(f"logical_sizes disagree for tensors sharing a storage: {sorted(found)}")
        value = found.pop()
    else:
        value = logical_sizes[index]
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"logical size of the storage of tensor {group.names[0]!r} must be an int, got {value!r}")
    return value
