"""Copy plans: turn (src ids, dst ids) into the fewest bulk tensor copies.

A batch copies row ``src_ids[i]`` of every source region into row ``dst_ids[i]``
of the matching destination region. Per-row ``copy_`` calls cost a few
microseconds of Python and dispatch each, which dominates for 16 KiB blocks, so
the plan groups rows into runs and picks, by a simple cost model, one of:

* ``dst_runs``  – sort by dst; each run of consecutive dst rows is one
  ``index_select(src, 0, idx, out=dst[a:b])`` (a plain slice copy when the src
  rows are consecutive too);
* ``src_runs``  – sort by src; each run of consecutive src rows is one
  ``dst.index_copy_(0, idx, src[a:b])`` (or a slice copy);
* ``hybrid``    – runs consecutive on both sides become slice copies, the
  leftover rows one gather + scatter;
* ``gather_scatter`` – one ``index_select`` into a temporary, one ``index_copy_``:
  two calls, but every byte moves twice.

Everything here except :meth:`CopyPlan.apply` is pure integer work.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import index as _as_int

import torch

from tiered_kv.errors import TransferError

# Dispatch cost of one tensor op, in "bytes of copying" it is worth (~5 us at
# ~10 GB/s). Only the order of magnitude matters: it decides when 64 per-row
# copies of 2 MiB beat a gather + scatter that moves every byte twice.
CALL_COST_BYTES = 64 * 1024

# Widest element type first: CPU index_copy_ / index_select run one element at a
# time, so viewing rows as int64 instead of uint8 makes them up to ~8x faster.
_WIDE_DTYPES = (torch.int64, torch.int32, torch.int16)


@dataclass(frozen=True, slots=True)
class SliceCopy:
    """``dst[dst_start:+length] = src[src_start:+length]``."""

    src_start: int
    dst_start: int
    length: int


@dataclass(frozen=True, slots=True)
class GatherRun:
    """``index_select(src, 0, src_ids, out=dst[dst_start:+len(src_ids)])``."""

    src_ids: tuple[int, ...]
    dst_start: int


@dataclass(frozen=True, slots=True)
class ScatterRun:
    """``dst.index_copy_(0, dst_ids, src[src_start:+len(dst_ids)])``."""

    src_start: int
    dst_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GatherScatter:
    """``dst.index_copy_(0, dst_ids, src.index_select(0, src_ids))``."""

    src_ids: tuple[int, ...]
    dst_ids: tuple[int, ...]


CopyOp = SliceCopy | GatherRun | ScatterRun | GatherScatter


@dataclass(frozen=True, slots=True)
class Run:
    """Rows that are consecutive on the side the run was grouped by."""

    src: tuple[int, ...]
    dst: tuple[int, ...]

    @property
    def src_contiguous(self) -> bool:
        return _consecutive(self.src)

    @property
    def dst_contiguous(self) -> bool:
        return _consecutive(self.dst)


@dataclass(frozen=True)
class CopyPlan:
    """An ordered list of bulk copies equivalent to the per-row copy."""

    ops: tuple[CopyOp, ...]
    count: int
    strategy: str
    _index_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def calls(self) -> int:
        """Tensor ops per region (a gather + scatter counts two)."""
        return sum(2 if isinstance(op, GatherScatter) else 1 for op in self.ops)

    def apply(self, src_regions: Sequence[torch.Tensor], dst_regions: Sequence[torch.Tensor]) -> None:
        """Run the plan on every (src, dst) region pair; blocking, call off the loop."""
        for src, dst in zip(src_regions, dst_regions, strict=True):
            src, dst = widen_pair(src, dst)
            for op in self.ops:
                _run_op(op, src, dst, self._indices(op, src.device))

    def _indices(self, op: CopyOp, device: torch.device) -> tuple[torch.Tensor, ...]:
        # Built once per op and device, then shared by every region of the batch.
        key = (id(op), device)
        cached = self._index_cache.get(key)
        if cached is None:
            if isinstance(op, GatherRun):
                cached = (_tensor(op.src_ids, device),)
            elif isinstance(op, ScatterRun):
                cached = (_tensor(op.dst_ids, device),)
            elif isinstance(op, GatherScatter):
                cached = (_tensor(op.src_ids, device), _tensor(op.dst_ids, device))
            else:
                cached = ()
            self._index_cache[key] = cached
        return cached


def check_ids(
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    *,
    src_len: int,
    dst_len: int,
    src_name: str = "src id",
    dst_name: str = "dst id",
) -> tuple[list[int], list[int]]:
    """Return both id lists as plain ints, or raise TransferError naming the numbers.

    Checks: equal lengths, every id in ``[0, len)`` (negative ids never wrap),
    no destination id twice (two rows racing for one block is always a bug).
    """
    src = _int_list(src_ids, src_name)
    dst = _int_list(dst_ids, dst_name)
    if len(src) != len(dst):
        raise TransferError(f"length mismatch: {len(src)} {src_name}s vs {len(dst)} {dst_name}s")
    _check_range(src, src_len, src_name)
    _check_range(dst, dst_len, dst_name)
    if len(set(dst)) != len(dst):
        seen: set[int] = set()
        for d in dst:
            if d in seen:
                raise TransferError(f"duplicate {dst_name} {d} in one batch")
            seen.add(d)
    return src, dst


def plan_copy(
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    *,
    src_len: int,
    dst_len: int,
    bytes_per_block: int = 0,
    regions: int = 1,
) -> CopyPlan:
    """Validate the ids (see :func:`check_ids`) and build the cheapest plan."""
    src, dst = check_ids(src_ids, dst_ids, src_len=src_len, dst_len=dst_len)
    return build_plan(src, dst, bytes_per_block=bytes_per_block, regions=regions)


def build_plan(src: list[int], dst: list[int], *, bytes_per_block: int = 0, regions: int = 1) -> CopyPlan:
    """Build the cheapest plan for already validated ids (see module docstring).

    This runs on the event loop for every batch, so candidates are compared by
    their call counts and only the winner's ops are built.
    """
    n = len(src)
    if n == 0:
        return CopyPlan((), 0, "empty")
    # Fast paths, the shapes the cache produces most: contiguous ids on one side.
    if _is_range(dst):
        op = SliceCopy(src[0], dst[0], n) if _is_range(src) else GatherRun(tuple(src), dst[0])
        return CopyPlan((op,), n, "dst_runs")
    if _is_range(src):
        return CopyPlan((ScatterRun(src[0], tuple(dst)),), n, "src_runs")

    call = CALL_COST_BYTES * max(regions, 1)
    nbytes = n * bytes_per_block
    order = sorted(range(n), key=dst.__getitem__)
    d = [dst[i] for i in order]
    s = [src[i] for i in order]
    dst_bounds = _bounds(d, None)
    both_bounds = _bounds(d, s)
    singles = sum(1 for a, b in zip(both_bounds, both_bounds[1:], strict=False) if b - a == 1)
    long_runs = len(both_bounds) - 1 - singles
    if len(set(src)) == n:
        src_count = len(_bounds(sorted(src), None)) - 1
    else:  # duplicated src ids: rare, take the exact (slower) grouping
        src_count = len(src_runs(src, dst))
    costs = {
        "dst_runs": (len(dst_bounds) - 1) * call + nbytes,
        "src_runs": src_count * call + nbytes,
        "hybrid": (long_runs + min(singles, 2)) * call
        + nbytes
        + (singles * bytes_per_block if singles > 1 else 0),
        "gather_scatter": 2 * call + 2 * nbytes,
    }
    if long_runs == 0:  # nothing to slice: hybrid would just be the gather + scatter
        del costs["hybrid"]
    # min() keeps the first of equal costs: runs before the double-copy fallbacks.
    name = min(costs, key=costs.__getitem__)
    if name == "dst_runs":
        ops = [_dst_run_op(Run(tuple(s[a:b]), tuple(d[a:b]))) for a, b in _pairs(dst_bounds)]
    elif name == "src_runs":
        ops = [_src_run_op(r) for r in src_runs(src, dst)]
    elif name == "hybrid":
        ops = _hybrid_ops(s, d, both_bounds)
    else:
        ops = [GatherScatter(tuple(src), tuple(dst))]
    return CopyPlan(tuple(ops), n, name)


def dst_runs(src: Sequence[int], dst: Sequence[int]) -> list[Run]:
    """Rows sorted by dst, split wherever dst stops being consecutive."""
    return _sorted_runs(src, dst, both=False)


def both_runs(src: Sequence[int], dst: Sequence[int]) -> list[Run]:
    """Rows sorted by dst, split wherever src or dst stops being consecutive."""
    return _sorted_runs(src, dst, both=True)


def src_runs(src: Sequence[int], dst: Sequence[int]) -> list[Run]:
    """Rows grouped into runs of consecutive src ids.

    A src id may appear more than once (one block copied to two places), so a
    row joins any open run that expects its id; ``[0, 0, 1, 1]`` gives two runs
    ``0..1`` rather than three.
    """
    open_runs: dict[int, list[list[int]]] = {}
    runs: list[list[int]] = []
    for i in sorted(range(len(src)), key=lambda i: (src[i], dst[i])):
        waiting = open_runs.get(src[i])
        if waiting:
            run = waiting.pop()
        else:
            run = []
            runs.append(run)
        run.append(i)
        open_runs.setdefault(src[i] + 1, []).append(run)
    return [Run(tuple(src[i] for i in r), tuple(dst[i] for i in r)) for r in runs]


def spans(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(offset, first_id, length)`` for each run of consecutive ids, in order."""
    out: list[tuple[int, int, int]] = []
    for off, i in enumerate(ids):
        if out and i == out[-1][1] + out[-1][2]:
            o, first, length = out[-1]
            out[-1] = (o, first, length + 1)
        else:
            out.append((off, i, 1))
    return out


def widen_pair(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """View two uint8 row tensors as the widest integer type both allow.

    Same bytes, fewer elements: the element-wise index kernels get much faster.
    ``view(dtype)`` refuses when a row size, stride or offset does not divide,
    and then the next narrower type is tried.
    """
    for dtype in _WIDE_DTYPES:
        try:
            return src.view(dtype), dst.view(dtype)
        except RuntimeError:
            continue
    return src, dst


def _run_op(op: CopyOp, src: torch.Tensor, dst: torch.Tensor, idx: tuple[torch.Tensor, ...]) -> None:
    if isinstance(op, SliceCopy):
        dst[op.dst_start : op.dst_start + op.length].copy_(src[op.src_start : op.src_start + op.length])
    elif isinstance(op, GatherRun):
        torch.index_select(src, 0, idx[0], out=dst[op.dst_start : op.dst_start + len(op.src_ids)])
    elif dst.device.type == "cpu" and src.device.type == "cpu" and dst.is_contiguous():
        # CPU index_copy_ walks elements; numpy's row scatter copies whole rows
        # (about 5x faster at 16 KiB) and releases the GIL as torch does.
        d = dst.numpy()
        if isinstance(op, ScatterRun):
            d[idx[0].numpy()] = src[op.src_start : op.src_start + len(op.dst_ids)].numpy()
        else:
            d[idx[1].numpy()] = src.index_select(0, idx[0]).numpy()
    elif isinstance(op, ScatterRun):
        dst.index_copy_(0, idx[0], src[op.src_start : op.src_start + len(op.dst_ids)])
    else:
        dst.index_copy_(0, idx[1], src.index_select(0, idx[0]))


def _dst_run_op(run: Run) -> CopyOp:
    if run.src_contiguous:
        return SliceCopy(run.src[0], run.dst[0], len(run.src))
    return GatherRun(run.src, run.dst[0])


def _src_run_op(run: Run) -> CopyOp:
    if run.dst_contiguous:
        return SliceCopy(run.src[0], run.dst[0], len(run.src))
    return ScatterRun(run.src[0], run.dst)


def _hybrid_ops(s: list[int], d: list[int], bounds: list[int]) -> list[CopyOp]:
    ops: list[CopyOp] = []
    rest: list[int] = []
    for a, b in _pairs(bounds):
        if b - a >= 2:
            ops.append(SliceCopy(s[a], d[a], b - a))
        else:
            rest.append(a)
    if len(rest) == 1:
        ops.append(SliceCopy(s[rest[0]], d[rest[0]], 1))
    elif rest:
        ops.append(GatherScatter(tuple(s[i] for i in rest), tuple(d[i] for i in rest)))
    return ops


def _sorted_runs(src: Sequence[int], dst: Sequence[int], *, both: bool) -> list[Run]:
    order = sorted(range(len(dst)), key=dst.__getitem__)
    d = [dst[i] for i in order]
    s = [src[i] for i in order]
    return [Run(tuple(s[a:b]), tuple(d[a:b])) for a, b in _pairs(_bounds(d, s if both else None))]


def _bounds(primary: list[int], secondary: list[int] | None) -> list[int]:
    """Run boundaries ``[0, ..., n]``: a run ends where ``primary`` (and, if given,
    ``secondary``) stops increasing by exactly one."""
    n = len(primary)
    if n == 0:
        return [0]
    if secondary is None:
        cuts = [k for k in range(1, n) if primary[k] != primary[k - 1] + 1]
    else:
        cuts = [
            k for k in range(1, n) if primary[k] != primary[k - 1] + 1 or secondary[k] != secondary[k - 1] + 1
        ]
    return [0, *cuts, n]


def _pairs(bounds: list[int]) -> list[tuple[int, int]]:
    return list(zip(bounds, bounds[1:], strict=False))


def _is_range(ids: Sequence[int]) -> bool:
    first = ids[0]
    return ids[-1] - first == len(ids) - 1 and list(ids) == list(range(first, first + len(ids)))


def _consecutive(ids: Sequence[int]) -> bool:
    return not ids or _is_range(ids)


def _int_list(ids: Sequence[int], name: str) -> list[int]:
    if isinstance(ids, torch.Tensor):
        ids = ids.tolist()
    try:
        return [_as_int(i) for i in ids]
    except TypeError as exc:
        raise TransferError(f"{name}s must be integers: {exc}") from exc


def _check_range(ids: list[int], length: int, name: str) -> None:
    if ids and (min(ids) < 0 or max(ids) >= length):
        bad = next(i for i in ids if i < 0 or i >= length)
        raise TransferError(f"{name} {bad} out of range [0, {length})")


def _tensor(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    # frombuffer over an array is ~3x cheaper than torch.tensor(list) for 64 ids.
    host = torch.frombuffer(array("q", ids), dtype=torch.int64)
    return host if device.type == "cpu" else host.to(device)
