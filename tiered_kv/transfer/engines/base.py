"""The copy-engine interface shared by the host and CUDA engines.

Bookkeeping here runs on the event-loop thread only (submit, resolve, close),
so it needs no locks. Engines move the bytes elsewhere (a worker thread, a CUDA
stream) and hand completion back with ``loop.call_soon_threadsafe(self._resolve, ...)``.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from abc import ABC, abstractmethod
from collections.abc import Generator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from ...core import core
from ...errors import LayoutError, TransferError

log = logging.getLogger(__name__)


# What a copy is ordered after: None (the current stream of the thread that submits), an event the
# caller recorded (torch.cuda.Event, or the generic torch.Event vLLM itself uses), or a torch.cuda.Stream
# (an event is recorded on it).
Compute = Any
_EVENT_TYPES = tuple(t for t in (getattr(torch, "Event", None), torch.cuda.Event) if isinstance(t, type))


def is_event(compute: Compute) -> bool:
    """A ``torch.cuda.Event`` or a generic ``torch.Event`` (they are unrelated classes)."""
    return isinstance(compute, _EVENT_TYPES)


def check_compute(compute: Compute) -> None:
    """Raise TransferError unless ``compute`` is None, a recorded event or a ``torch.cuda.Stream``.

    An event is a ``torch.cuda.Event`` or a generic ``torch.Event`` (vLLM records those). One that was
    never recorded would make the copy stream's wait a no-op (CUDA waits on nothing), so a
    ``torch.cuda.Event`` that was not is refused rather than silently unordered (a generic event does
    not say whether it was: the caller's recording is trusted).
    """
    if compute is None or isinstance(compute, torch.cuda.Stream):
        return
    if isinstance(compute, torch.cuda.Event):
        if getattr(compute, "cuda_event", 1) == 0:
            raise TransferError("compute: the torch.cuda.Event was never recorded; record it on the compute stream first")
        return
    if is_event(compute):
        device = getattr(compute, "device", None)
        if device is not None and getattr(device, "type", "cuda") not in ("cuda", "cpu"):
            raise TransferError(f"compute: a torch.Event on {device} cannot order a CUDA copy")
        return
    raise TransferError(
        f"compute must be None, a torch.cuda.Event or a torch.cuda.Stream, got {type(compute).__name__} (the "
        f"generic torch.Event is accepted too)"
    )


def compute_event(compute: Compute) -> Compute:
    """``compute`` as an event recorded now: a stream gets one recorded on it (at this call), others pass through."""
    check_compute(compute)
    if isinstance(compute, torch.cuda.Stream):
        event = torch.cuda.Event()
        event.record(compute)  # the event is created on the stream's device (torch guards it)
        return event
    return compute


class Direction(enum.Enum):
    STORE = "store"  # GPU -> CPU
    LOAD = "load"  # CPU -> GPU


class CopyHandle:
    """One submitted batch.

    ``future`` belongs to the engine: it resolves only once every byte of the
    batch has landed (or fails with TransferError). Awaiting the handle awaits a
    shield of it, so cancelling the awaiting task never cancels the copy; the
    caller must not reuse the slots/blocks until ``done()``.
    """

    __slots__ = ("future", "nbytes", "direction", "event")

    def __init__(self, future: asyncio.Future[None], nbytes: int, direction: Direction) -> None:
        self.future = future
        self.nbytes = nbytes
        self.direction = direction
        # The CUDA completion event (CUDAStreamEngine only): a compute stream can
        # ``wait_event`` on it instead of waiting for the loop to hear about it.
        self.event: Any = None

    def done(self) -> bool:
        return self.future.done()

    def __await__(self) -> Generator[Any, None, None]:
        return asyncio.shield(self.future).__await__()

    def __repr__(self) -> str:
        return f"CopyHandle({self.direction.value}, nbytes={self.nbytes}, done={self.done()})"


class CopyEngine(ABC):
    """Copies whole blocks (all regions) between GPU blocks and CPU slots."""

    copy_path: str | None = None  # the copy path an engine chose at start (cuda.py, direct.py, host.py name theirs)

    def __init__(self, gpu_regions: Sequence[torch.Tensor], cpu_regions: Sequence[torch.Tensor]) -> None:
        self._gpu = tuple(gpu_regions)
        self._cpu = tuple(cpu_regions)
        validate_regions(self._gpu, self._cpu)
        self.num_blocks = int(self._gpu[0].shape[0])
        self.num_slots = int(self._cpu[0].shape[0])
        self.block_bytes = tuple(int(t.shape[1]) for t in self._gpu)
        self.bytes_per_block = sum(self.block_bytes)
        self._pending: set[asyncio.Future[None]] = set()
        self._idle: asyncio.Future[None] | None = None
        self._closed = False
        self._close_task: asyncio.Future[None] | None = None

    @property
    def inflight(self) -> int:
        """Batches submitted whose copy has not finished yet."""
        return len(self._pending)

    @property
    def closed(self) -> bool:
        return self._closed

    def submit_store(
        self, gpu_ids: Sequence[int] | np.ndarray, cpu_slots: Sequence[int] | np.ndarray, *, compute: Compute = None
    ) -> CopyHandle:
        """Copy GPU blocks ``gpu_ids[i]`` into CPU slots ``cpu_slots[i]``, after ``compute`` (see ``check_compute``)."""
        check_compute(compute)
        src, dst = check_id_arrays(
            gpu_ids, cpu_slots, src_len=self.num_blocks, dst_len=self.num_slots,
            src_name="gpu block id", dst_name="cpu slot",
        )  # fmt: skip
        return self._submit(Direction.STORE, src, dst, compute)

    def submit_load(
        self, cpu_slots: Sequence[int] | np.ndarray, gpu_ids: Sequence[int] | np.ndarray, *, compute: Compute = None
    ) -> CopyHandle:
        """Copy CPU slots ``cpu_slots[i]`` into GPU blocks ``gpu_ids[i]``, after ``compute`` (see ``check_compute``)."""
        check_compute(compute)
        src, dst = check_id_arrays(
            cpu_slots, gpu_ids, src_len=self.num_slots, dst_len=self.num_blocks,
            src_name="cpu slot", dst_name="gpu block id",
        )  # fmt: skip
        return self._submit(Direction.LOAD, src, dst, compute)

    async def aclose(self) -> None:
        """Refuse new batches, wait for every in-flight one, release resources. Idempotent."""
        self._closed = True
        if self._close_task is None:
            self._close_task = asyncio.ensure_future(self._drain_and_release())
        await asyncio.shield(self._close_task)

    async def __aenter__(self) -> CopyEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    # -- for subclasses ---------------------------------------------------

    @abstractmethod
    def _launch(
        self, direction: Direction, src: np.ndarray, dst: np.ndarray, handle: CopyHandle,
        loop: asyncio.AbstractEventLoop, compute: Compute,
    ) -> None:  # fmt: skip
        """Start the copy (ids are validated int64 arrays) after ``compute`` (checked by ``check_compute``);
        arrange ``loop.call_soon_threadsafe(self._resolve, fut, err)`` at the end."""

    @abstractmethod
    def _release(self) -> None:
        """Free threads/streams; called once, after every batch has finished."""

    def _resolve(self, future: asyncio.Future[None], error: BaseException | None) -> None:
        """Mark a batch finished; runs on the loop thread."""
        self._pending.discard(future)
        if not future.done():  # a caller may have cancelled it despite the docs
            if error is None:
                future.set_result(None)
            else:
                future.set_exception(error)
        elif error is not None:
            log.error("transfer failed after its future was cancelled: %s", error)
        if not self._pending and self._idle is not None and not self._idle.done():
            self._idle.set_result(None)

    # -- internals --------------------------------------------------------

    def _submit(self, direction: Direction, src: np.ndarray, dst: np.ndarray, compute: Compute) -> CopyHandle:
        if self._closed:
            raise TransferError(f"submit_{direction.value} on a closed {type(self).__name__}")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise TransferError(f"submit_{direction.value} must be called on the event loop thread") from None
        future: asyncio.Future[None] = loop.create_future()
        handle = CopyHandle(future, len(src) * self.bytes_per_block, direction)
        self._pending.add(future)
        try:
            self._launch(direction, src, dst, handle, loop, compute)
        except BaseException as exc:
            # Nothing was queued (engines launch atomically or report through the future).
            self._pending.discard(future)
            future.cancel()
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"could not start {direction.value} of {len(src)} blocks: {exc}") from exc
        return handle

    async def _drain_and_release(self) -> None:
        loop = asyncio.get_running_loop()
        while self._pending:
            self._idle = loop.create_future()
            await self._idle
        self._release()


# -- optional copy modes: what an engine offers beyond submit_store / submit_load, declared here so that
# callers test ``isinstance(engine, InlineCopies)`` instead of probing with getattr.


@runtime_checkable
class InlineCopies(Protocol):
    """Copies a small batch synchronously on the calling thread (the host engine)."""

    def copy_inline(self, direction: Direction, src: np.ndarray, dst: np.ndarray) -> bool: ...


@runtime_checkable
class ThreadedCopies(Protocol):
    """Starts a batch on the engine's worker with one hand-off and a ``done(error)`` callback on the loop."""

    def copy_threaded(self, direction: Direction, src: np.ndarray, dst: np.ndarray, token: asyncio.Future,
                      done: Any) -> None: ...  # fmt: skip


@runtime_checkable
class NowCopies(Protocol):
    """Queues a batch from any thread with no asyncio future (the cross-process proxy engine)."""

    def copy_now(self, direction: Direction, src_ids: np.ndarray, dst_ids: np.ndarray, done: Any) -> None: ...


@runtime_checkable
class CountedCopies(Protocol):
    """Loop-free copies (the worker's ShardCopier): started from the caller's thread, finished per direction
    in start order, completion read from a counter. ``start_copy`` returns the batch's sequence number in its
    direction (1, 2, ...); it checks nothing it cannot check cheaply: a bad id fails the batch, reported by
    ``copies_done``. ``copies_done`` never blocks: (the sequence number through which every batch of that
    direction has finished, {sequence number: error message} of the failed ones not reported before).
    ``wait_copies`` blocks with the GIL released until batch ``seq`` of ``direction`` has finished (False
    on timeout). ``close_copies`` waits for every started batch, then frees the engine's threads and streams."""

    def start_copy(self, direction: Direction, src: np.ndarray, dst: np.ndarray, compute: Compute = None) -> int: ...

    def copies_done(self, direction: Direction) -> tuple[int, dict[int, str]]: ...

    def wait_copies(self, direction: Direction, seq: int, timeout_s: float | None = None) -> bool: ...

    def close_copies(self) -> None: ...


def check_id_arrays(
    src_ids: Sequence[int] | np.ndarray,
    dst_ids: Sequence[int] | np.ndarray,
    *,
    src_len: int,
    dst_len: int,
    src_name: str = "src id",
    dst_name: str = "dst id",
) -> tuple[np.ndarray, np.ndarray]:
    """Both id lists as int64 arrays, or TransferError naming the numbers.

    Checks: equal lengths, every id in ``[0, len)`` (negative ids never wrap),
    no destination id twice (two rows racing for one block is always a bug). One native pass, the direct
    road's own check (``core.check_copy_ids``; its numpy reference: tests/reference_core/copy_ids.py);
    a tensor of ids is read on the host first.
    """
    if isinstance(src_ids, torch.Tensor):
        src_ids = src_ids.cpu().numpy()
    if isinstance(dst_ids, torch.Tensor):
        dst_ids = dst_ids.cpu().numpy()
    return core.check_copy_ids(src_ids, dst_ids, src_len, dst_len, src_name, dst_name)


def validate_regions(gpu: Sequence[torch.Tensor], cpu: Sequence[torch.Tensor]) -> None:
    """Raise LayoutError unless both sides are matching lists of 2-D uint8 tensors."""
    if not gpu:
        raise LayoutError("a copy engine needs at least one region, got 0 gpu regions")
    if len(gpu) != len(cpu):
        raise LayoutError(f"region count mismatch: {len(gpu)} gpu regions vs {len(cpu)} cpu regions")
    for side, regions in (("gpu", gpu), ("cpu", cpu)):
        for r, t in enumerate(regions):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 2:
                what = (
                    f"{t.dtype} tensor of {t.dim()} dims" if isinstance(t, torch.Tensor) else type(t).__name__
                )
                raise LayoutError(f"{side} region {r} must be a 2-D uint8 tensor, got {what}")
            if t.shape[0] > 1 and (t.stride(0) < t.shape[1] or t.stride(1) != 1):
                raise LayoutError(f"{side} region {r}: rows overlap or are not dense (strides {list(t.stride())})")
        rows = {int(t.shape[0]) for t in regions}
        if len(rows) != 1:
            raise LayoutError(f"{side} regions disagree on the block count: {sorted(rows)}")
    for r, (g, c) in enumerate(zip(gpu, cpu, strict=True)):
        if g.shape[1] != c.shape[1]:
            raise LayoutError(
                f"region {r}: gpu block_bytes {int(g.shape[1])} != cpu block_bytes {int(c.shape[1])}"
            )
