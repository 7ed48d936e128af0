"""ShardCopier: a TP rank's copies between its GPU KV tensors and its sub-slab of the shared CPU segment.

The worker holds no bookkeeping: it maps the engine's segment, checks that its own per-rank bytes
per block is the segment's (LayoutError naming both otherwise), issues the jobs it is sent without
waiting for them, and hands back which finished at its next ``poll``.

The segment is rank-major (tiers/segment_geometry.py): this rank's shard of every slot is one contiguous,
page-aligned sub-slab, so the copies are exactly the TP=1 ones, at every TP size, and a CUDA rank
page-locks only its own sub-slab (in ``tiers.cpu.pin_chunk`` chunks). The copies run on a copy engine
over (this rank's registered KV views, its sub-slab), from the one engine factory (``make_engine(...,
counted=True)``): a ``CountedCopies`` engine (transfer/engines/base.py, counted.py). There is no copier
thread and no event loop (issue 46 item 6): ``submit`` starts each job on the caller's (the model
runner's) thread and returns, the engine's own threads or streams move the bytes and bump a completion
counter per direction, ``poll`` reads the counters (never blocking) and maps them to job ids (a deque of
(sequence number, job id) per direction), and ``wait`` sleeps in the engine with the GIL released.
Host copies are the native row copies on the engine's worker thread per direction (no torch intra-op
pool in a foreign thread). CUDA copies (the direct road or CUDAStreamEngine) are ordered after an event
recorded in the caller's thread, on its current stream, when ``submit`` is called: a store submitted
after the forward (vLLM's wait_for_save) reads what the forward wrote, a load submitted before it
(start_load_kv) lands before attention reads it (``wait`` for a synchronous one).

KV replicated across ``kv_replicas`` consecutive ranks (MLA) is stored once (tiers/segment_geometry.py):
the ranks of a replica set share one sub-slab, every one of them loads from it, and only the first
(``SegmentInfo.stores``) copies a store into it. The others report each store job done without copying
anything, so the scheduler's proxy still resolves a job on a report from every rank.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, LayoutError, TransferError
from ..layout import KVLayout
from ..tiers.fs_kind import check_pinnable
from ..tiers.pinning import HostRegistration, pin_chunks, warn_if_memlock_low
from ..tiers.segment_geometry import SegmentInfo, storage_ranks
from ..tiers.shared_cpu import SharedSegment
from ..transfer.engines import make_engine
from ..transfer.engines.base import CountedCopies, Direction, compute_event
from .layer_loads import LayeredLoad, LayerLoads
from .shard_jobs import STORE, ShardJob

if TYPE_CHECKING:
    from .layer_loads_direct import DirectLayeredLoad, DirectLayerLoads

log = logging.getLogger(__name__)


class ShardCopier:
    """Copies rank ``rank``'s shard of the jobs it is given (see the module docstring)."""

    def __init__(self, layout: KVLayout, *, rank: int, world_size: int, engine: str = "auto",
                 pin_chunk: int = 1 << 30, kv_replicas: int = 1) -> None:  # fmt: skip
        if not isinstance(layout, KVLayout) or not layout.is_bound:
            raise LayoutError("ShardCopier needs this rank's layout bound to its KV tensors (KVLayout.from_tensors)")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise LayoutError(f"rank must be in [0, world_size): rank={rank!r}, world_size={world_size!r}")
        storage_ranks(world_size, kv_replicas)  # ConfigError unless kv_replicas divides world_size
        if engine == "auto":
            engine = "cuda" if layout.device.type == "cuda" else "host"
        if engine not in ("host", "cuda"):
            raise ConfigError(f"transfer.engine must be auto, host or cuda for a worker; got {engine!r}")
        if engine == "cuda" and layout.device.type != "cuda":
            raise ConfigError(f"transfer.engine: cuda needs KV tensors on a CUDA device; this rank's are on "
                              f"{layout.device}")  # fmt: skip
        self.layout = layout
        self.rank = rank
        self.world_size = world_size
        self.kv_replicas = kv_replicas
        # The first rank of each replica set writes the shared sub-slab; the others only acknowledge stores.
        self.stores = rank % kv_replicas == 0
        self.skipped_stores = 0  # store jobs acknowledged without a copy (another rank of the set wrote them)
        self.kind = engine
        self.pin_chunk = pin_chunk  # tiers.cpu.pin_chunk: CUDA registers this rank's sub-slab in chunks of this size
        self.segment: SharedSegment | None = None
        self._engine: CountedCopies | None = None
        self._cpu_regions: list = []  # this rank's sub-slab, one view per region
        # Layer-wise synchronous loads: a host engine's thread (layer_loads.py), or the direct road's marks on
        # CUDA (layer_loads_direct.py); the table and stream paths keep whole-step loads.
        self._layers: LayerLoads | DirectLayerLoads | None = None
        self._dma_rows: int | None = None  # CUDA: rows per DMA of the pinned sub-slab (its pinned chunks)
        self._pinned: HostRegistration | None = None
        self._lock = threading.Condition(threading.Lock())
        self._ok: list[int] = []  # finished since the last poll
        self._failed: list[int] = []
        # Per direction, in start order: (the engine's sequence number, job id) not yet seen finished.
        self._inflight: dict[Direction, deque[tuple[int, int]]] = {d: deque() for d in Direction}
        self._layered: set[int] = set()  # layered loads' jobs not finished (their thread reports them)
        self._failures: dict[Direction, dict[int, str]] = {d: {} for d in Direction}  # seq -> error, read, unmatched
        self._closed = False

    # -- setup ------------------------------------------------------------------------------
    def open(self, info: SegmentInfo) -> None:
        """Create or attach to the engine's segment (idempotent for the same one) and build the copy engine.

        ``info`` is computed from this rank's own numbers (tiers.segment_geometry.segment_info_for with its
        bound layout), so a segment another rank or the scheduler made for other per-rank bytes per block is
        refused with both numbers (LayoutError).
        """
        if self.segment is not None:
            if self.segment.info == info:
                return
            raise LayoutError(f"rank {self.rank} is attached to {self.segment.info.path}; it cannot switch to "
                              f"{info.path}")  # fmt: skip
        if info.world_size != self.world_size:
            raise LayoutError(f"the scheduler's segment is for world_size {info.world_size} but this worker is "
                              f"rank {self.rank} of {self.world_size}")  # fmt: skip
        if info.kv_replicas != self.kv_replicas:
            raise LayoutError(f"the segment info is for kv_replicas {info.kv_replicas} (TP ranks holding identical "
                              f"KV, stored once) but TP rank {self.rank} was built for {self.kv_replicas}")  # fmt: skip
        if info.stores(self.rank) != self.stores:
            raise LayoutError(f"TP rank {self.rank} {'would' if self.stores else 'would not'} copy stores into its "
                              f"sub-slab, but in the segment (kv_replicas {info.kv_replicas}) rank "
                              f"{info.storage_rank_of(self.rank) * info.kv_replicas} alone writes it")  # fmt: skip
        if info.shard_bytes != self.layout.bytes_per_block:
            raise LayoutError(f"TP rank {self.rank}: its KV tensors give {self.layout.bytes_per_block} bytes per block "
                              f"but the segment info says {info.shard_bytes}")  # fmt: skip
        if self.kind == "cuda":  # refused at start, by name, rather than by cudaHostRegister's error 1 later
            check_pinnable(os.path.dirname(info.path) or ".", why=f"TP rank {self.rank}'s CUDA copy engine "
                           f"page-locks its sub-slab of the segment there")  # fmt: skip
        seg = SharedSegment.open(info)
        try:
            import torch

            # Contiguous: the TP=1 copy path as is (ranks of one replica set map the same sub-slab).
            shard = torch.from_numpy(seg.shard(self.rank))
            cpu, offset = [], 0
            for block_bytes in self.layout.region_block_bytes:
                cpu.append(shard[:, offset : offset + block_bytes])
                offset += block_bytes
            self._engine = self._build(list(self.layout.regions), cpu, seg)
            self._cpu_regions = cpu
        except BaseException:
            self._unpin()
            seg.close()
            raise
        self.segment = seg

    def _build(self, gpu: list, cpu: list, seg: SharedSegment) -> CountedCopies:
        dma_rows = None
        if self.kind == "cuda":
            self._pinned, dma_rows = _pin(seg, self.rank, self.layout.device, self.pin_chunk)
            self._dma_rows = dma_rows
        engine = make_engine(self.kind, gpu, cpu, dma_rows=dma_rows, counted=True)
        if not isinstance(engine, CountedCopies):  # the factory's promise for counted=True
            raise ConfigError(f"the {self.kind} copy engine {type(engine).__name__} has no loop-free copies")
        return engine

    @property
    def copy_path(self) -> str | None:
        """The copy path this rank's engine chose at start (direct, table, table-direct, groups, host-rows)."""
        return None if self._engine is None else self._engine.copy_path

    # -- the step's calls (any thread, never blocking) ------------------------------------------
    def submit(self, jobs: Sequence[ShardJob]) -> None:
        """Start the jobs (in order per direction) on this thread and return; their outcome comes from ``poll``.
        A job that cannot start (a closed engine, an id the CUDA engine refuses) is reported failed."""
        if not jobs:
            return
        engine = self._engine
        if engine is None or self._closed:
            raise TransferError(f"rank {self.rank}: submit before open() or after close()")
        # CUDA: the event is recorded here, in the caller's (model runner's) thread on its current stream;
        # the copy stream waits for it, so a store reads what the forward pass wrote.
        ready = _compute_event(self.layout.device) if self.kind == "cuda" else None
        for job in jobs:
            if job.direction == STORE and not self.stores:  # replicated KV: the set's first rank copies it
                self.skipped_stores += 1
                with self._lock:
                    self._ok.append(job.job_id)
                continue
            try:
                if job.direction == STORE:
                    seq = engine.start_copy(Direction.STORE, job.gpu_ids, job.cpu_slots, ready)
                else:
                    seq = engine.start_copy(Direction.LOAD, job.cpu_slots, job.gpu_ids, ready)
            except Exception as exc:  # a bad id or a closed engine: nothing was queued
                log.error("tiered_kv rank %d: job %d could not start: %s", self.rank, job.job_id, exc)
                with self._lock:
                    self._failed.append(job.job_id)
                continue
            with self._lock:
                self._inflight[Direction.STORE if job.direction == STORE else Direction.LOAD].append((seq, job.job_id))

    def enable_layers(self, groups: dict[str, list[int]]) -> bool:
        """Copy synchronous loads layer group by group (``submit_layered``) when there is more than one group
        of regions: on a host engine (layer_loads.py) or CUDA's direct road (layer_loads_direct.py: one mark
        per group on the load stream). False: not here (CUDA's table and stream paths keep whole-step loads)."""
        if self._engine is None or self._layers is not None:
            return self._layers is not None
        layers = self._layered_loads(groups)
        if layers is None:
            return False
        if layers.num_groups < 2:
            layers.close()
            return False
        self._layers = layers
        return True

    def _layered_loads(self, groups: dict[str, list[int]]) -> LayerLoads | DirectLayerLoads | None:
        if self.kind == "host":
            return LayerLoads(list(self.layout.regions), self._cpu_regions, groups)
        if self.copy_path == "direct":  # the marks need the direct road's rows (opt-in until measured)
            from .layer_loads_direct import DirectLayerLoads  # torch and the CUDA driver: a CUDA rank only

            return DirectLayerLoads(list(self.layout.regions), self._cpu_regions, groups, dma_rows=self._dma_rows)
        return None

    def submit_layered(self, jobs: Sequence[ShardJob]) -> LayeredLoad | DirectLayeredLoad:
        """Issue LOAD jobs layer group by group (enable_layers first); wait on the returned handle per layer.
        Their outcome comes from ``poll`` as any job's."""
        if self._layers is None or self._closed:
            raise TransferError(f"rank {self.rank}: submit_layered without enable_layers() or after close()")
        with self._lock:
            self._layered.update(j.job_id for j in jobs)
        return self._layers.start(jobs, self._finished)

    def poll(self) -> tuple[list[int], list[int]]:
        """(ok job ids, failed job ids) finished since the last poll: reads the engine's counters, never blocks."""
        self._poll_layers()
        with self._lock:
            self._collect()
            ok, failed = self._ok, self._failed
            self._ok, self._failed = [], []
        return ok, failed

    @property
    def pending(self) -> int:
        """Jobs submitted whose copy has not finished."""
        self._poll_layers()
        with self._lock:
            self._collect()
            return sum(len(q) for q in self._inflight.values()) + len(self._layered)

    def wait(self, job_ids: Sequence[int], timeout_s: float | None = None) -> None:
        """Block, the GIL released, until these jobs have finished on this rank (a fence: e.g. before preempted
        blocks are reused). Their outcome still comes from ``poll``."""
        ids = {int(j) for j in job_ids}
        with self._lock:
            self._collect()
            last = {d: max((seq for seq, j in q if j in ids), default=0) for d, q in self._inflight.items()}
        if not self._wait_for(last, lambda: self._layered.isdisjoint(ids), timeout_s):
            with self._lock:
                self._collect()
                still = sorted(({j for q in self._inflight.values() for _, j in q} | self._layered) & ids)
            raise TransferError(f"rank {self.rank}: jobs {still} still copying after {timeout_s} s")

    def drain(self, timeout_s: float | None = None) -> tuple[list[int], list[int]]:
        """Wait until every submitted job has finished (a flush fence), then ``poll``."""
        with self._lock:
            last = {d: q[-1][0] if q else 0 for d, q in self._inflight.items()}
        if not self._wait_for(last, lambda: not self._layered, timeout_s):
            raise TransferError(f"rank {self.rank}: {self.pending} jobs still copying after {timeout_s} s")
        return self.poll()

    def close(self) -> None:
        """Wait for every copy, then stop the engine and detach. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._layers is not None:
                self._layers.close()  # its copies end first
            if self._engine is not None:
                self._engine.close_copies()  # waits for every copy in flight first
        finally:
            self._unpin()
            if self.segment is not None:
                self.segment.close()

    # -- completion ---------------------------------------------------------------------------
    def _collect(self) -> None:
        """(under the lock) Move the jobs the engine's counters say have finished to the ok / failed lists."""
        if self._engine is None:
            return
        for direction, queue in self._inflight.items():
            if not queue:
                continue  # (a failure of a job not queued yet stays with the engine until it is)
            done, failed = self._engine.copies_done(direction)
            failures = self._failures[direction]
            failures.update(failed)  # kept until matched: a job may be queued here just after its copy ended
            while queue and queue[0][0] <= done:
                seq, job_id = queue.popleft()
                if seq in failures:
                    log.error("tiered_kv rank %d: job %d failed: %s", self.rank, job_id, failures.pop(seq))
                    self._failed.append(job_id)
                else:
                    self._ok.append(job_id)

    def _wait_for(self, last: dict[Direction, int], layered_done: Any, timeout_s: float | None) -> bool:
        """Until each direction's batch ``last[d]`` has finished (in the engine, the GIL released) and
        ``layered_done()`` holds; False at the deadline."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        left = lambda: None if deadline is None else max(0.0, deadline - time.monotonic())  # noqa: E731
        for direction, seq in last.items():
            if seq and not self._engine.wait_copies(direction, seq, left()):
                return False
        if self._layers is not None:
            try:
                self._layers.wait(left())  # the direct road's loads, reported as they land (a host engine's
            except TransferError:  # report by themselves)
                return False
        with self._lock:
            return self._lock.wait_for(layered_done, left())

    def _poll_layers(self) -> None:
        """(not under the lock) Layered loads that report through ``poll`` (the direct road's) report now."""
        if self._layers is not None:
            self._layers.poll()

    def _finished(self, job_id: int, ok: bool) -> None:
        """A layered load's job is over (the host loads' thread, or ``_poll_layers``, calls this)."""
        with self._lock:
            (self._ok if ok else self._failed).append(job_id)
            self._layered.discard(job_id)
            self._lock.notify_all()

    def _unpin(self) -> None:
        pinned, self._pinned = self._pinned, None
        if pinned is not None:
            pinned.release()


def _compute_event(device: Any) -> Any:
    """An event recorded now on the calling thread's current stream of the KV tensors' device."""
    import torch

    return compute_event(torch.cuda.current_stream(device))


def _pin(seg: SharedSegment, rank: int, device: Any, chunk: int) -> tuple[HostRegistration, int | None]:
    """Page-lock this rank's sub-slab of the segment (only its own: 1/TP of the segment) by the CPU tier's
    rules (tiers/pinning.py: chunks of whole pages and rows); returns the registration and the rows per
    chunk (a DMA never crosses a chunk's edge)."""
    sub = seg.shard(rank)
    info = seg.info
    warn_if_memlock_low(sub.nbytes)
    chunks = pin_chunks(sub.nbytes, info.shard_bytes, max(chunk, 1 << 20), page=info.page)
    registration = HostRegistration(device)
    base = sub.ctypes.data  # page-aligned: every sub-slab starts on a page of its own (segment_geometry)
    try:
        for start, size in chunks:
            registration.register(base + start, size, what=f"offset {start} of rank {rank}'s sub-slab of the shared "
                                                           f"CPU tier segment {info.path}")  # fmt: skip
    except BaseException:
        registration.release()
        raise
    return registration, (chunks[0][1] // info.shard_bytes if len(chunks) > 1 else None)
