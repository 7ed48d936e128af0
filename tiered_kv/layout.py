"""The logical KV layout: the one place ``bytes_per_block`` comes from.

A GPU allocator rounds each KV allocation up (4 KiB in vLLM), so a storage's
*physical* size can exceed its *logical* size. Every view here is bounded by
the logical size; the physical size is only checked to be large enough
(vLLM PR #54021: a quotient over the physical size turned 4 KiB of padding
into 31 bogus regions and the worker held fewer slots than the scheduler).

A layout is unambiguous or refused: dim 0 must be exactly ``num_blocks``
unless the caller declares otherwise (``block_dim`` for ``[2, num_blocks, ...]``,
``rows_per_block`` for several rows per block). Guessing is how a stacked
K-then-V tensor once moved V pages into the wrong blocks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .errors import LayoutError
from .layout_tensors import Declared, TensorSpec, group_by_storage, logical_size

if TYPE_CHECKING:  # torch is imported where tensors are handled, so config tools start fast
    import torch

_DIGEST_VERSION = "tkv-layout-v2"


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
    ``tensors`` describes what the engine registered (names, order, dtypes,
    shapes, strides); it is what the digest identifies, and ``spec()`` carries
    it to a scheduler process that holds no tensors.
    """

    num_blocks: int
    storages: tuple[StorageSpec, ...]
    region_block_bytes: tuple[int, ...]
    regions: tuple[torch.Tensor, ...] = field(default=(), compare=False, repr=False)
    tensors: tuple[TensorSpec, ...] = ()
    block_tokens: int | None = None  # tokens per block, when the engine says

    # -- construction -------------------------------------------------------------
    @classmethod
    def from_specs(
        cls,
        specs: Sequence[StorageSpec],
        num_blocks: int,
        *,
        tensors: Sequence[TensorSpec] = (),
        block_tokens: int | None = None,
    ) -> KVLayout:
        """The scheduler-side layout: sizes only, no tensors."""
        if not specs:
            raise LayoutError("a KV layout needs at least one storage")
        region_bytes: list[int] = []
        for spec in specs:
            region_bytes += [spec.block_bytes] * spec.regions(num_blocks)
        return cls(num_blocks, tuple(specs), tuple(region_bytes), (), tuple(tensors), block_tokens)

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
        *,
        block_dim: Declared = None,
        rows_per_block: Declared = None,
        block_tokens: int | None = None,
    ) -> KVLayout:
        """Register real KV tensors, each storage once, viewed over its logical bytes.

        Dim 0 of each tensor must be exactly ``num_blocks`` unless declared:
        ``block_dim`` (an int for every tensor, or per name) names the dim that
        counts blocks, e.g. 1 for ``[2, num_blocks, ...]`` (K then V); every dim
        before it splits the tensor into separate regions. ``rows_per_block``
        says how many consecutive rows of the block dim make one block. A dim 0
        of ``num_blocks`` while another dim also equals ``num_blocks`` is
        ambiguous and must be declared too.

        ``logical_sizes`` are the scheduler's per-storage byte sizes, in order of
        first appearance (a sequence) or by the name of any tensor on that
        storage (a mapping). They must equal what the registered views cover:
        never ``untyped_storage().nbytes()``, never more than the views reach.
        """
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise LayoutError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if block_tokens is not None and (isinstance(block_tokens, bool) or not isinstance(block_tokens, int)
                                         or block_tokens <= 0):  # fmt: skip
            raise LayoutError(f"block_tokens must be a positive int, got {block_tokens!r}")
        if not isinstance(kv_caches, Mapping) or not kv_caches:
            raise LayoutError("kv_caches must be a non-empty mapping of name -> tensor")
        groups, tensor_specs = group_by_storage(kv_caches, num_blocks, block_dim, rows_per_block)
        if isinstance(logical_sizes, Sequence) and len(logical_sizes) != len(groups):
            raise LayoutError(
                f"logical_sizes has {len(logical_sizes)} entries but the tensors use {len(groups)} distinct storages"
            )
        specs: list[StorageSpec] = []
        views: list[torch.Tensor] = []
        for i, group in enumerate(groups):
            logical = logical_size(group, i, logical_sizes)
            if group.extent > logical:
                raise LayoutError(
                    f"tensor {group.names[0]!r} reaches byte {group.extent} of its storage, past the logical "
                    f"size {logical}"
                )
            if logical > group.extent:
                raise LayoutError(
                    f"logical size {logical} of the storage of tensor {group.names[0]!r} exceeds the "
                    f"{group.extent} bytes its registered tensors cover (was the padded, physical size passed?)"
                )
            spec = StorageSpec(logical, group.block_bytes, group.storage.nbytes())
            n_regions = spec.regions(num_blocks)
            import torch

            flat = torch.empty(0, dtype=torch.uint8, device=group.device)
            # The view covers exactly the logical bytes: padding is never a region.
            flat.set_(group.storage, 0, (logical,), (1,))
            views += list(flat.view(n_regions, num_blocks, group.block_bytes).unbind(0))
            specs.append(spec)
        region_bytes = tuple(v.shape[1] for v in views)
        return cls(num_blocks, tuple(specs), region_bytes, tuple(views), tuple(tensor_specs), block_tokens)

    def bind(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        logical_sizes: Sequence[int] | Mapping[str, int] | None = None,
        **declared: Any,
    ) -> KVLayout:
        """Bind this scheduler-side layout to real tensors; they must agree exactly."""
        declared.setdefault("block_tokens", self.block_tokens)
        bound = KVLayout.from_tensors(kv_caches, self.num_blocks, logical_sizes, **declared)
        if bound.region_block_bytes != self.region_block_bytes:
            raise LayoutError(
                f"tensors give bytes_per_block={bound.bytes_per_block} ({bound.num_regions} regions) but the "
                f"scheduler planned bytes_per_block={self.bytes_per_block} ({self.num_regions} regions)"
            )
        if self.tensors and bound.digest != self.digest:
            raise LayoutError(
                f"tensors give layout digest {bound.digest} but the scheduler planned {self.digest}: names, order, "
                f"dtypes or shapes differ"
            )
        return bound

    # -- a tensor-free description for another process -------------------------------
    def spec(self) -> dict[str, Any]:
        """JSON-able description; ``KVLayout.from_spec`` rebuilds it (same digest) without tensors."""
        return {
            "version": _DIGEST_VERSION,
            "num_blocks": self.num_blocks,
            "block_tokens": self.block_tokens,
            "storages": [[s.logical_nbytes, s.block_bytes] for s in self.storages],
            "tensors": [t.as_list() for t in self.tensors],
        }

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> KVLayout:
        try:
            if spec["version"] != _DIGEST_VERSION:
                raise LayoutError(f"layout spec version {spec['version']!r}, expected {_DIGEST_VERSION!r}")
            storages = [StorageSpec(int(n), int(b)) for n, b in spec["storages"]]
            tensors = [TensorSpec.from_list(t) for t in spec["tensors"]]
            return cls.from_specs(storages, int(spec["num_blocks"]), tensors=tensors,
                                  block_tokens=spec.get("block_tokens"))  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, LayoutError):
                raise
            raise LayoutError(f"malformed layout spec: {exc!r}") from None

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
        import torch

        return self.regions[0].device if self.regions else torch.device("cpu")

    @property
    def dtype(self) -> str | None:
        """The KV element type, when every tensor has the same one (raw byte tensors carry none)."""
        names = {t.dtype for t in self.tensors if t.dtype != "uint8"}
        return names.pop() if len(names) == 1 else None

    @property
    def digest(self) -> str:
        """Short digest of what the engine registered, independent of num_blocks.

        It covers every region's block bytes and every tensor's name, order,
        dtype, per-block shape and strides, and declarations, so a renamed,
        reordered or reshaped layout files its blocks under another namespace.
        """
        doc = [_DIGEST_VERSION, list(self.region_block_bytes), [t.digest_part() for t in self.tensors]]
        text = json.dumps(doc, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def slots_for(self, capacity_bytes: int) -> int:
        """Slots a tier of ``capacity_bytes`` holds: the scheduler's and the worker's number."""
        if capacity_bytes < 0:
            raise LayoutError(f"capacity must not be negative, got {capacity_bytes}")
        return capacity_bytes // self.bytes_per_block
