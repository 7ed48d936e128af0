"""Copy engines (host always, cuda when a GPU is present) and copy plans."""

from __future__ import annotations

import asyncio
import random
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from tiered_kv.core import core
from tiered_kv.errors import ConfigError, LayoutError, TransferError
from tiered_kv.layout import KVLayout
from tiered_kv.tiers.cpu import CpuSlabs
from tiered_kv.transfer import CopyEngine, HostCopyEngine, make_engine
from tiered_kv.transfer.engines.base import Direction
from tiered_kv.transfer.engines.bridge import EventBridge
from tiered_kv.transfer.engines.direct import DirectCopyEngine
from tiered_kv.transfer.engines.staged import Staging, enqueue_load, enqueue_store, gpu_groups, host_slabs

fake_cuda = core.fake_cuda
BLOCK_BYTES = (4096, 300, 64)
NUM_BLOCKS = 40
NUM_SLOTS = 32
# direct-fake: the direct road's engine (transfer/engines/direct.py) over the native fake CUDA driver.
ENGINES = ["host", "direct-fake", pytest.param("cuda", marks=pytest.mark.gpu)]


def build(kind: str, gpu, cpu):
    if kind == "direct-fake":
        return DirectCopyEngine(gpu, cpu, driver="fake:13000")
    return make_engine(kind, gpu, cpu)


def make_regions(kind: str, block_bytes=BLOCK_BYTES, num_blocks=NUM_BLOCKS, num_slots=NUM_SLOTS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gpu = [torch.randint(0, 256, (num_blocks, b), dtype=torch.uint8, generator=gen) for b in block_bytes]
    cpu = [torch.randint(0, 256, (num_slots, b), dtype=torch.uint8, generator=gen) for b in block_bytes]
    if kind == "cuda":
        gpu = [g.cuda() for g in gpu]
        cpu = [c.pin_memory() for c in cpu]
    return gpu, cpu


def snapshot(regions):
    return [r.cpu().clone() for r in regions]


@pytest.fixture(params=ENGINES)
async def rig(request):
    gpu, cpu = make_regions(request.param)
    engine = build(request.param, gpu, cpu)
    yield engine, gpu, cpu
    await engine.aclose()


def _ids(pattern: str, n: int, universe: int, rng: random.Random) -> list[int]:
    if pattern == "contiguous":
        start = rng.randrange(universe - n + 1)
        return list(range(start, start + n))
    if pattern == "scattered":
        return rng.sample(range(universe), n)
    if pattern == "reversed":
        return list(range(n - 1, -1, -1))
    # mixed: a contiguous run, then scattered ids from the rest
    head = list(range(3, 3 + n // 2))
    return head + rng.sample([i for i in range(universe) if i not in head], n - len(head))


PATTERNS = ["contiguous", "scattered", "reversed", "mixed"]


def assert_copied(src_before, dst_before, dst_after, src_ids, dst_ids):
    """dst rows got exactly the src rows; every other dst row kept its bytes."""
    for s_b, d_b, d_a in zip(src_before, dst_before, dst_after, strict=True):
        for s, d in zip(src_ids, dst_ids, strict=True):
            assert torch.equal(d_a[d], s_b[s]), f"row {d} != source row {s}"
        untouched = [i for i in range(d_b.shape[0]) if i not in set(dst_ids)]
        assert torch.equal(d_a[untouched], d_b[untouched])


@pytest.mark.parametrize("src_pattern", PATTERNS)
@pytest.mark.parametrize("dst_pattern", PATTERNS)
async def test_store_is_byte_exact(rig, src_pattern, dst_pattern):
    engine, gpu, cpu = rig
    rng = random.Random(f"{src_pattern}-{dst_pattern}")
    gpu_ids = _ids(src_pattern, 12, NUM_BLOCKS, rng)
    slots = _ids(dst_pattern, 12, NUM_SLOTS, rng)
    gpu_before, cpu_before = snapshot(gpu), snapshot(cpu)
    handle = engine.submit_store(gpu_ids, slots)
    assert handle.nbytes == 12 * sum(BLOCK_BYTES)
    await handle
    assert handle.done() and engine.inflight == 0
    assert_copied(gpu_before, cpu_before, snapshot(cpu), gpu_ids, slots)
    assert all(torch.equal(a, b) for a, b in zip(gpu_before, snapshot(gpu), strict=True))


@pytest.mark.parametrize("src_pattern", PATTERNS)
@pytest.mark.parametrize("dst_pattern", PATTERNS)
async def test_load_is_byte_exact(rig, src_pattern, dst_pattern):
    engine, gpu, cpu = rig
    rng = random.Random(f"load-{src_pattern}-{dst_pattern}")
    slots = _ids(src_pattern, 12, NUM_SLOTS, rng)
    gpu_ids = _ids(dst_pattern, 12, NUM_BLOCKS, rng)
    gpu_before, cpu_before = snapshot(gpu), snapshot(cpu)
    await engine.submit_load(slots, gpu_ids)
    assert_copied(cpu_before, gpu_before, snapshot(gpu), slots, gpu_ids)
    assert all(torch.equal(a, b) for a, b in zip(cpu_before, snapshot(cpu), strict=True))


async def test_round_trip_restores_exact_bytes(rig):
    engine, gpu, cpu = rig
    rng = random.Random(7)
    gpu_ids = rng.sample(range(NUM_BLOCKS), 16)
    slots = rng.sample(range(NUM_SLOTS), 16)
    original = snapshot(gpu)
    await engine.submit_store(gpu_ids, slots)
    targets = [i for i in range(NUM_BLOCKS) if i not in gpu_ids][:16]
    rng.shuffle(targets)
    await engine.submit_load(slots, targets)
    after = snapshot(gpu)
    for before, now in zip(original, after, strict=True):
        for g, t in zip(gpu_ids, targets, strict=True):
            assert torch.equal(now[t], before[g])
        untouched = [i for i in range(NUM_BLOCKS) if i not in targets]
        assert torch.equal(now[untouched], before[untouched])


async def test_duplicate_sources_are_allowed(rig):
    engine, gpu, cpu = rig
    gpu_before, cpu_before = snapshot(gpu), snapshot(cpu)
    await engine.submit_store([5, 5, 6, 6], [0, 1, 2, 3])
    assert_copied(gpu_before, cpu_before, snapshot(cpu), [5, 5, 6, 6], [0, 1, 2, 3])


async def test_empty_batch_completes(rig):
    engine, _, _ = rig
    handle = engine.submit_store([], [])
    await handle
    assert handle.nbytes == 0


async def test_batches_complete_in_submission_order(rig):
    engine, gpu, cpu = rig
    rng = random.Random(3)
    finished: list[tuple[str, int]] = []
    handles = []
    for k in range(24):
        # Every batch writes the same destinations, so the final bytes also prove
        # the batches *ran* in order, not just that their futures resolved in order.
        store = engine.submit_store(rng.sample(range(NUM_BLOCKS), 6), list(range(6)))
        load = engine.submit_load(rng.sample(range(6, NUM_SLOTS), 6), list(range(34, 40)))
        for name, h in (("store", store), ("load", load)):
            h.future.add_done_callback(lambda _f, name=name, k=k: finished.append((name, k)))
            handles.append((name, h))
    for _, h in handles:
        await h
    await asyncio.sleep(0)  # let the done callbacks run
    for name in ("store", "load"):
        assert [k for n, k in finished if n == name] == list(range(24))
    assert engine.inflight == 0


async def test_last_batch_wins_on_shared_destinations(rig):
    engine, gpu, cpu = rig
    gpu_before = snapshot(gpu)
    for k in range(20):
        handle = engine.submit_store([k, k + 1], [0, 1])
    await handle
    after = snapshot(cpu)
    for region_before, region_after in zip(gpu_before, after, strict=True):
        assert torch.equal(region_after[0], region_before[19])
        assert torch.equal(region_after[1], region_before[20])


class GatedRows:
    """Row copies that wait for the test to open a gate: a copy held open, instead of one raced against a timer."""

    def __init__(self, rows) -> None:
        self.rows, self.gate, self.started = rows, threading.Event(), threading.Event()

    def copy(self, side, src, dst) -> None:
        self.started.set()
        if not self.gate.wait(timeout=30):
            raise RuntimeError("the test never opened the gate")
        self.rows.copy(side, src, dst)


def hold_copies(kind: str, engine):
    """Hold the engine's next copies until the returned ``release()`` is called. Host: the rows wait on a
    gate. CUDA: the copy is ordered after a compute stream that spins until released (``_sleep``)."""
    if kind == "host":
        gated = GatedRows(engine._rows)
        engine._rows = gated
        return None, gated.gate.set
    if kind == "direct-fake":  # the fake driver's copy stream runs nothing until released
        stream = engine.stream_handle(Direction.STORE)
        fake_cuda.hold(stream)
        return None, lambda: fake_cuda.hold(stream, False)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU clocks: far past the cancel below
    return stream, lambda: None


@pytest.mark.parametrize("kind", ENGINES)
async def test_cancelling_the_waiter_does_not_cancel_the_copy(kind):
    # The copy is held until the cancel has been seen, so it cannot land first (a 24 MiB host copy
    # on a quiet machine did, and the test then saw no CancelledError).
    gpu, cpu = make_regions(kind, block_bytes=(1 << 20,), num_blocks=24, num_slots=24)
    gpu_before = snapshot(gpu)
    gpu_ids, slots = list(range(23, -1, -1)), list(range(24))
    async with build(kind, gpu, cpu) as engine:
        compute, release = hold_copies(kind, engine)
        handle = engine.submit_store(gpu_ids, slots, compute=compute)

        async def waiter():
            await handle

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0)  # the task is now awaiting the handle
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not handle.future.cancelled() and not handle.done()  # still held: the cancel did not end it
        release()
        await handle
    assert handle.future.done() and handle.future.exception() is None
    after = snapshot(cpu)
    assert_copied(gpu_before, after, after, gpu_ids, slots)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda e: e.submit_store([1, 2], [1]), "length mismatch: 2 gpu block ids vs 1 cpu slots"),
        (
            lambda e: e.submit_store([NUM_BLOCKS], [0]),
            f"gpu block id {NUM_BLOCKS} out of range [0, {NUM_BLOCKS})",
        ),
        (lambda e: e.submit_store([-1], [0]), "gpu block id -1 out of range"),
        (lambda e: e.submit_store([0], [NUM_SLOTS]), f"cpu slot {NUM_SLOTS} out of range [0, {NUM_SLOTS})"),
        (lambda e: e.submit_store([1, 2], [3, 3]), "duplicate cpu slot 3"),
        (lambda e: e.submit_load([0, 1], [7, 7]), "duplicate gpu block id 7"),
        (lambda e: e.submit_load([NUM_SLOTS + 5], [0]), f"cpu slot {NUM_SLOTS + 5} out of range"),
        (lambda e: e.submit_load([0.5], [0]), "cpu slots must be integers"),
    ],
)
async def test_bad_ids_raise_before_anything_is_queued(rig, call, message):
    engine, gpu, cpu = rig
    gpu_before, cpu_before = snapshot(gpu), snapshot(cpu)
    with pytest.raises(TransferError, match=message.replace("[", r"\[").replace(")", r"\)")):
        call(engine)
    assert engine.inflight == 0
    await asyncio.sleep(0.01)
    assert all(
        torch.equal(a, b) for a, b in zip(gpu_before + cpu_before, snapshot(gpu) + snapshot(cpu), strict=True)
    )


@pytest.mark.parametrize(
    ("gpu_shapes", "cpu_shapes", "message"),
    [
        ([(8, 64), (8, 32)], [(4, 64)], "region count mismatch: 2 gpu regions vs 1 cpu regions"),
        ([(8, 64), (8, 32)], [(4, 64), (4, 48)], "region 1: gpu block_bytes 32 != cpu block_bytes 48"),
        ([(8, 64), (9, 32)], [(4, 64), (4, 32)], r"gpu regions disagree on the block count: \[8, 9\]"),
        ([], [], "at least one region"),
    ],
)
def test_bad_layouts_raise_layout_error(gpu_shapes, cpu_shapes, message):
    gpu = [torch.zeros(s, dtype=torch.uint8) for s in gpu_shapes]
    cpu = [torch.zeros(s, dtype=torch.uint8) for s in cpu_shapes]
    with pytest.raises(LayoutError, match=message):
        HostCopyEngine(gpu, cpu)


@pytest.mark.parametrize(
    "bad", [torch.zeros((8, 16), dtype=torch.float16), torch.zeros(128, dtype=torch.uint8)]
)
def test_regions_must_be_2d_uint8(bad):
    with pytest.raises(LayoutError, match="gpu region 0 must be a 2-D uint8 tensor"):
        HostCopyEngine([bad], [torch.zeros((4, 16), dtype=torch.uint8)])


class FailingRows:
    """Row copies that fail once (the native copier checks its ids first, so a real copy cannot fail)."""

    def __init__(self, rows) -> None:
        self.rows, self.failed = rows, False

    def copy(self, side, src, dst) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("the copy itself failed")
        self.rows.copy(side, src, dst)


async def test_copy_failure_fails_the_future_with_transfer_error():
    gpu = [torch.zeros((8, 64), dtype=torch.uint8)]
    cpu = [torch.ones((8, 64), dtype=torch.uint8)]
    async with HostCopyEngine(gpu, cpu) as engine:
        engine._rows = FailingRows(engine._rows)
        handle = engine.submit_load([0, 1, 2], [4, 5, 6])
        with pytest.raises(TransferError, match="load of 3 blocks failed") as info:
            await handle
        assert isinstance(info.value.__cause__, RuntimeError)
        assert engine.inflight == 0
        await engine.submit_store([0], [0])  # the engine keeps working afterwards


def test_overlapping_rows_are_refused():
    # An expanded (stride-0) tensor: every block row is the same memory.
    gpu = [torch.zeros((1, 64), dtype=torch.uint8).expand(8, 64)]
    with pytest.raises(LayoutError, match="gpu region 0: rows overlap"):
        HostCopyEngine(gpu, [torch.ones((8, 64), dtype=torch.uint8)])


async def test_aclose_drains_and_is_idempotent(rig):
    engine, _, _ = rig
    handles = [engine.submit_store([k, k + 1], [k, k + 1]) for k in range(0, 30, 2)]
    handles += [engine.submit_load([k], [39 - k]) for k in range(10)]
    await engine.aclose()
    assert all(h.done() for h in handles) and engine.inflight == 0
    await engine.aclose()
    with pytest.raises(TransferError, match="closed"):
        engine.submit_store([0], [0])
    with pytest.raises(TransferError, match="closed"):
        engine.submit_load([0], [0])


async def test_concurrent_aclose_calls_share_one_drain(rig):
    engine, _, _ = rig
    handle = engine.submit_store(list(range(20)), list(range(20)))
    await asyncio.gather(engine.aclose(), engine.aclose())
    assert handle.done() and engine.closed


async def test_compute_must_be_an_event_or_a_stream(rig):
    engine, gpu, cpu = rig
    before = snapshot(cpu)
    for bad in ("stream", 7, torch.zeros(1)):
        with pytest.raises(TransferError, match=rf"compute must be None, a torch.cuda.Event or a torch.cuda.Stream, "
                                                rf"got {type(bad).__name__} \(the generic torch.Event"):  # fmt: skip
            engine.submit_store([0], [0], compute=bad)
        with pytest.raises(TransferError, match="compute must be"):
            engine.submit_load([0], [0], compute=bad)
    assert engine.inflight == 0 and all(torch.equal(a, b) for a, b in zip(snapshot(cpu), before, strict=True))
    await engine.submit_store([3], [1], compute=None)
    assert torch.equal(cpu[0][1].cpu(), gpu[0][3].cpu())


def test_the_generic_torch_event_vllm_records_is_accepted():
    """Defect E (issue 27): vLLM orders its own copies with ``torch.Event``, a class unrelated to torch.cuda.Event."""
    from tiered_kv.transfer.engines.base import check_compute, compute_event, is_event

    event = torch.Event()
    assert not isinstance(event, torch.cuda.Event) and is_event(event)
    check_compute(event)  # refused before: "compute must be None, a torch.cuda.Event or a torch.cuda.Stream"
    assert compute_event(event) is event


def test_submit_outside_the_event_loop_raises():
    gpu, cpu = make_regions("host")
    engine = HostCopyEngine(gpu, cpu)
    with pytest.raises(TransferError, match="event loop thread"):
        engine.submit_store([0], [0])
    asyncio.run(engine.aclose())


async def test_make_engine_kinds():
    gpu, cpu = make_regions("host")
    engine = make_engine("auto", gpu, cpu)
    assert isinstance(engine, HostCopyEngine) and isinstance(engine, CopyEngine)
    await engine.aclose()
    with pytest.raises(ConfigError, match="'gpu-direct'"):
        make_engine("gpu-direct", gpu, cpu)
    with pytest.raises(LayoutError, match="gpu region 0 is on cpu"):
        make_engine("cuda", gpu, cpu)  # refused before any CUDA call


# -- the event -> asyncio bridge (CPU stand-in events) -------------------------


class ThreadEvent:
    """A stand-in for torch.cuda.Event: synchronize() blocks until set()."""

    def __init__(self, fail: bool = False) -> None:
        self._done = threading.Event()
        self._fail = fail

    def set(self) -> None:
        self._done.set()

    def synchronize(self) -> None:
        self._done.wait(5)
        if self._fail:
            raise RuntimeError("device lost")


async def test_bridge_resolves_in_fifo_order_without_blocking_the_loop():
    loop = asyncio.get_running_loop()
    bridge = EventBridge("test-waiter")
    events = [ThreadEvent() for _ in range(5)]
    futures = [loop.create_future() for _ in events]
    order: list[int] = []

    def resolve(fut, err):
        order.append(futures.index(fut))
        fut.set_result(err)

    for ev, fut in zip(events, futures, strict=True):
        bridge.watch(ev, fut, loop, resolve)
    await asyncio.sleep(0.02)
    assert not any(f.done() for f in futures)  # the loop ran while the waiter blocked
    for ev in reversed(events):  # completion order on the device does not matter
        ev.set()
    await asyncio.gather(*futures)
    assert order == [0, 1, 2, 3, 4]
    bridge.stop()
    await asyncio.sleep(0.05)
    assert not bridge.alive


async def test_bridge_reports_errors_after_the_event():
    loop = asyncio.get_running_loop()
    bridge = EventBridge("test-waiter")
    failing, late = ThreadEvent(fail=True), ThreadEvent()
    got: dict[str, BaseException | None] = {}
    f1, f2 = loop.create_future(), loop.create_future()

    def resolve(fut, err):
        got["f1" if fut is f1 else "f2"] = err
        fut.set_result(None)

    bridge.watch(failing, f1, loop, resolve)
    bridge.watch(late, f2, loop, resolve, error=TransferError("enqueue failed"))
    failing.set()
    await f1
    assert isinstance(got["f1"], TransferError) and isinstance(got["f1"].__cause__, RuntimeError)
    await asyncio.sleep(0.02)
    assert not f2.done()  # an enqueue error waits for the event: no copy may still run
    late.set()
    await f2
    assert str(got["f2"]) == "enqueue failed"
    bridge.stop()
    with pytest.raises(TransferError, match="stopped"):
        bridge.watch(late, loop.create_future(), loop, resolve)


async def test_bridge_runs_on_start_on_its_own_thread_before_any_wait():
    # The CUDA engine sets its device there: a wait on a thread whose current device
    # is GPU 0 would create a context on GPU 0 (TP rank > 0).
    seen: list[tuple[str, str]] = []

    class Recorded(ThreadEvent):
        def synchronize(self) -> None:
            seen.append(("wait", threading.current_thread().name))

    loop = asyncio.get_running_loop()
    bridge = EventBridge("start-waiter", on_start=lambda: seen.append(("start", threading.current_thread().name)))
    fut = loop.create_future()
    bridge.watch(Recorded(), fut, loop, lambda f, err: f.set_result(err))
    assert await fut is None
    assert seen == [("start", "start-waiter"), ("wait", "start-waiter")]
    bridge.stop()


# -- plans -----------------------------------------------------------------


def copies(draw):
    src_len = draw(st.integers(1, 24))
    dst_len = draw(st.integers(1, 24))
    n = draw(st.integers(0, dst_len))
    dst = draw(st.permutations(range(dst_len)))[:n]
    src = draw(st.lists(st.integers(0, src_len - 1), min_size=n, max_size=n))
    row_bytes = draw(st.sampled_from([1, 3, 8, 12, 64]))
    bytes_per_block = draw(st.sampled_from([0, 16, 4096, 1 << 22]))
    return src, dst, src_len, dst_len, row_bytes, bytes_per_block


def cpu_side(layout: str, widths, num_slots: int, order, gen):
    """CPU regions: column views of one block-major slab (regions placed in ``order``), or separate tensors."""
    if layout == "separate":
        return [torch.randint(0, 256, (num_slots, w), dtype=torch.uint8, generator=gen) for w in widths], None
    slab = torch.randint(0, 256, (num_slots, sum(widths)), dtype=torch.uint8, generator=gen)
    offsets, pos = [0] * len(widths), 0
    for r in order:  # region r's columns need not follow region r-1's
        offsets[r], pos = pos, pos + widths[r]
    return [slab[:, o : o + w] for o, w in zip(offsets, widths, strict=True)], slab


def _drawn_ids(draw, universe: int, n: int, unique: bool) -> list[int]:
    pattern = draw(st.sampled_from(["scattered", "run", "rotated_run", "sorted"]))
    if pattern in ("run", "rotated_run") and n <= universe:
        start = draw(st.integers(0, universe - n))
        ids = list(range(start, start + n))
        k = draw(st.integers(0, n)) if pattern == "rotated_run" else 0
        return ids[k:] + ids[:k]  # two runs, out of order
    if unique:
        ids = draw(st.permutations(range(universe)))[:n]
    else:
        ids = draw(st.lists(st.integers(0, universe - 1), min_size=n, max_size=n))
    return sorted(ids) if pattern == "sorted" else ids


@st.composite
def engine_copies(draw):
    widths = draw(st.lists(st.sampled_from([1, 3, 8, 40, 64, 300, 4096]), min_size=1, max_size=4))
    num_blocks, num_slots = draw(st.integers(1, 20)), draw(st.integers(1, 20))
    store = draw(st.booleans())
    # Destinations are distinct (the engine validates that); sources may repeat.
    src_len, dst_len = (num_blocks, num_slots) if store else (num_slots, num_blocks)
    n = draw(st.integers(0, dst_len))
    src = _drawn_ids(draw, src_len, n, unique=False)
    dst = _drawn_ids(draw, dst_len, n, unique=True)
    order = draw(st.permutations(range(len(widths))))
    return widths, num_blocks, num_slots, store, src, dst, order


@settings(max_examples=200, deadline=None)
@given(engine_copies(), st.sampled_from([1, 100, 4096, 1 << 30]), st.sampled_from(["slab", "separate"]),
       st.sampled_from([None, 1, 2, 3, 7]))  # fmt: skip
def test_cuda_enqueue_logic_matches_naive_copy(case, staging_limit, layout, dma_rows):
    widths, num_blocks, num_slots, store, src_ids, dst_ids, order = case
    gen = torch.Generator().manual_seed(len(src_ids) + 7 * len(widths))
    gpu = [torch.randint(0, 256, (num_blocks, w), dtype=torch.uint8, generator=gen) for w in widths]
    cpu, _ = cpu_side(layout, widths, num_slots, order, gen)
    slabs = host_slabs(cpu)
    assert len(slabs) == (1 if layout == "slab" or len(widths) == 1 else len(widths))
    src, dst = (gpu, cpu) if store else (cpu, gpu)
    expected = [d.clone() for d in dst]
    for s, d in zip(src, expected, strict=True):
        for i, j in zip(src_ids, dst_ids, strict=True):
            d[j] = s[i]
    staging = Staging(torch.device("cpu"), staging_limit)
    src_arr, dst_arr = np.array(src_ids, dtype=np.int64), np.array(dst_ids, dtype=np.int64)
    if store:
        enqueue_store(gpu, slabs, src_arr, dst_arr, staging, torch.from_numpy, dma_rows)
    else:
        enqueue_load(gpu, slabs, src_arr, dst_arr, staging, torch.from_numpy, dma_rows)
    for r, (got, want) in enumerate(zip(dst, expected, strict=True)):
        assert torch.equal(got, want), f"region {r} differs from the per-row copy"


class HostCopies(TorchDispatchMode):
    """Records every non-view op that reads or writes one host buffer (a real dispatch hook, not a mock)."""

    def __init__(self, host: torch.Tensor) -> None:
        super().__init__()
        self.ptr = host.untyped_storage().data_ptr()
        self.ops: list[tuple[str, list[tuple[int, ...]], list[bool]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not func.is_view:
            tensors = [t for t in [*args, *kwargs.values()] if isinstance(t, torch.Tensor)]
            on_host = [t for t in tensors if t.untyped_storage().data_ptr() == self.ptr]
            if on_host:
                shapes = [tuple(t.shape) for t in on_host]
                self.ops.append((str(func), shapes, [t.is_contiguous() for t in on_host]))
        return func(*args, **kwargs)


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize(("staging_limit", "runs"), [(1 << 20, [3, 2, 1]), (2 * 372, [2, 1, 1, 1, 1])])
def test_block_major_host_side_is_one_contiguous_copy_per_run(store, staging_limit, runs):
    # Strided host copies are what the block-major path exists to avoid: every
    # op touching the slab must be a plain copy_ of whole contiguous rows, one
    # per run of consecutive slots (split where a staging chunk ends).
    widths, num_blocks = (64, 300, 8), 24
    gen = torch.Generator().manual_seed(3)
    gpu = [torch.randint(0, 256, (num_blocks, w), dtype=torch.uint8, generator=gen) for w in widths]
    cpu, slab = cpu_side("slab", widths, 24, [2, 0, 1], gen)
    slots = np.array([9, 10, 2, 3, 4, 20], dtype=np.int64)  # runs 2-4, 9-10, 20
    gpu_ids = np.array([17, 1, 5, 23, 0, 11], dtype=np.int64)
    before = [t.clone() for t in (cpu if store else gpu)]
    slabs, staging = host_slabs(cpu), Staging(torch.device("cpu"), staging_limit)
    with HostCopies(slab) as seen:
        if store:
            enqueue_store(gpu, slabs, gpu_ids, slots, staging, torch.from_numpy)
        else:
            enqueue_load(gpu, slabs, slots, gpu_ids, staging, torch.from_numpy)
    assert [op for op, _, _ in seen.ops] == ["aten.copy_.default"] * len(runs)
    assert [shapes for _, shapes, _ in seen.ops] == [[(n, sum(widths))] for n in runs]
    assert all(all(contig) for _, _, contig in seen.ops)
    src, dst = (gpu, cpu) if store else (cpu, gpu)
    for s, d, b in zip(src, dst, before, strict=True):
        want = b.clone()
        want[torch.from_numpy(slots if store else gpu_ids)] = s[torch.from_numpy(gpu_ids if store else slots)]
        assert torch.equal(d, want)


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("widths", [(64, 300, 8), (512,)], ids=["staged", "direct"])
def test_no_dma_crosses_a_registered_chunk_edge(store, widths):
    # The slab is registered in chunks of 4 rows here: the run of slots 2-9 becomes 2-3, 4-7, 8-9.
    gen = torch.Generator().manual_seed(5)
    gpu = [torch.randint(0, 256, (24, w), dtype=torch.uint8, generator=gen) for w in widths]
    cpu, slab = cpu_side("slab", widths, 16, list(range(len(widths))), gen)
    slab = slab if slab is not None else cpu[0]
    slots = np.array([2, 3, 4, 5, 6, 7, 8, 9], dtype=np.int64)
    gpu_ids = np.arange(10, 18, dtype=np.int64)  # consecutive: single-region slabs copy directly
    before = [t.clone() for t in (cpu if store else gpu)]
    slabs, staging = host_slabs(cpu), Staging(torch.device("cpu"), 1 << 20)
    with HostCopies(slab) as seen:
        if store:
            enqueue_store(gpu, slabs, gpu_ids, slots, staging, torch.from_numpy, 4)
        else:
            enqueue_load(gpu, slabs, slots, gpu_ids, staging, torch.from_numpy, 4)
    assert [shapes[0][0] for _, shapes, _ in seen.ops] == [2, 4, 2]
    src, dst = (gpu, cpu) if store else (cpu, gpu)
    for s, d, b in zip(src, dst, before, strict=True):
        want = b.clone()
        want[torch.from_numpy(slots if store else gpu_ids)] = s[torch.from_numpy(gpu_ids if store else slots)]
        assert torch.equal(d, want)


def gpu_side(kind: str, widths, num_blocks: int, gen) -> list[torch.Tensor]:
    """GPU regions as engines hand them over: separate tensors, regions cut region-major from one storage
    (``KVLayout.from_tensors``: ``[n, num_blocks, w]``), side by side in each row, or two storages."""
    def region_major(ws):
        flat = torch.randint(0, 256, (len(ws) * num_blocks * ws[0],), dtype=torch.uint8, generator=gen)
        return list(flat.view(len(ws), num_blocks, ws[0]).unbind(0))

    if kind == "separate" or len(set(widths)) > 1 and kind == "region_major":
        return [torch.randint(0, 256, (num_blocks, w), dtype=torch.uint8, generator=gen) for w in widths]
    if kind == "region_major":
        return region_major(widths)
    if kind == "in_rows":
        rows = torch.randint(0, 256, (num_blocks, sum(widths) + 8), dtype=torch.uint8, generator=gen)  # + a gap
        return list(torch.split(rows[:, : sum(widths)], list(widths), dim=1))
    half = len(widths) // 2  # two storages (one, for a lone region)
    if half == 0:
        return region_major(widths)
    return gpu_side("region_major", widths[:half], num_blocks, gen) + gpu_side("in_rows", widths[half:], num_blocks, gen)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6), st.sampled_from([8, 40, 64]), st.sampled_from(["region_major", "in_rows", "two"]),
       st.integers(1, 12), st.data())  # fmt: skip
def test_gather_per_storage_matches_naive_copy(n_regions, width, kind, num_blocks, data):
    widths = [width] * n_regions
    gen = torch.Generator().manual_seed(n_regions * 31 + num_blocks)
    gpu = gpu_side(kind, widths, num_blocks, gen)
    order = data.draw(st.sampled_from([list(range(n_regions)), list(range(n_regions))[::-1],
                                       data.draw(st.permutations(range(n_regions)))]))  # fmt: skip
    num_slots = data.draw(st.integers(1, 12))
    store = data.draw(st.booleans())
    src_len, dst_len = (num_blocks, num_slots) if store else (num_slots, num_blocks)
    n = data.draw(st.integers(0, dst_len))
    src_ids = _drawn_ids(data.draw, src_len, n, unique=False)
    dst_ids = _drawn_ids(data.draw, dst_len, n, unique=True)
    cpu, _ = cpu_side("slab", widths, num_slots, order, gen)
    src, dst = (gpu, cpu) if store else (cpu, gpu)
    expected = [d.clone() for d in dst]
    for s, d in zip(src, expected, strict=True):
        for i, j in zip(src_ids, dst_ids, strict=True):
            d[j] = s[i]
    staging = Staging(torch.device("cpu"), data.draw(st.sampled_from([width, 3 * width * n_regions, 1 << 20])))
    src_arr, dst_arr = np.array(src_ids, dtype=np.int64), np.array(dst_ids, dtype=np.int64)
    slabs = host_slabs(cpu)
    if store:
        enqueue_store(gpu, slabs, src_arr, dst_arr, staging, torch.from_numpy)
    else:
        enqueue_load(gpu, slabs, src_arr, dst_arr, staging, torch.from_numpy)
    for r, (got, want) in enumerate(zip(dst, expected, strict=True)):
        assert torch.equal(got, want), f"region {r} differs from the per-row copy"


class IndexKernels(TorchDispatchMode):
    """Counts the device index kernels (gathers and scatters) a batch queues."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "index_select" in str(func) or "index_copy" in str(func):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("store", [True, False])
def test_one_index_kernel_per_storage_per_chunk(store):
    # Two layers, K and V each, cut region-major from one storage per layer (as KVLayout.from_tensors
    # does): one gather per layer, not one per region.
    gen = torch.Generator().manual_seed(9)
    num_blocks, width = 16, 64
    gpu = gpu_side("region_major", [width] * 2, num_blocks, gen) + gpu_side("region_major", [width] * 2, num_blocks, gen)
    cpu, _ = cpu_side("slab", [width] * 4, 8, [0, 1, 2, 3], gen)
    assert [g.regions for g in gpu_groups(gpu, host_slabs(cpu)[0])] == [(0, 1), (2, 3)]
    gpu_ids, slots = np.array([9, 2, 14, 5], dtype=np.int64), np.array([0, 1, 2, 3], dtype=np.int64)
    staging = Staging(torch.device("cpu"), 2 * 4 * width)  # two rows per chunk: two chunks
    before = [t.clone() for t in (cpu if store else gpu)]
    with IndexKernels() as kernels:
        if store:
            enqueue_store(gpu, host_slabs(cpu), gpu_ids, slots, staging, torch.from_numpy)
        else:
            enqueue_load(gpu, host_slabs(cpu), slots, gpu_ids, staging, torch.from_numpy)
    assert kernels.count == 2 * 2, f"{kernels.count} index kernels for 2 storages x 2 chunks"
    src, dst = (gpu, cpu) if store else (cpu, gpu)
    for s, d, b in zip(src, dst, before, strict=True):
        want = b.clone()
        want[torch.from_numpy(slots if store else gpu_ids)] = s[torch.from_numpy(gpu_ids if store else slots)]
        assert torch.equal(d, want)


def test_host_slabs_finds_the_cpu_tier_slab():
    layout = KVLayout.from_block_bytes([4096, 300, 64], num_blocks=4)
    tier = CpuSlabs(layout, 6, pin="off")
    (found,) = host_slabs(tier.regions)
    assert found.rows.data_ptr() == tier.slab.data_ptr() and found.rows.shape == tier.slab.shape
    assert found.rows.is_contiguous() and found.offsets == tuple(tier.offsets) == (0, 4096, 4396)
    # Regions handed over in another order keep their own offsets.
    (shuffled,) = host_slabs([tier.regions[2], tier.regions[0], tier.regions[1]])
    assert shuffled.offsets == (4396, 0, 4096) and shuffled.rows.data_ptr() == tier.slab.data_ptr()
    # Separate contiguous tensors: one slab per region.
    separate = [torch.zeros((6, w), dtype=torch.uint8) for w in (16, 300)]
    assert [(s.regions, s.offsets) for s in host_slabs(separate)] == [((0,), (0,)), ((1,), (0,))]


@pytest.mark.parametrize(
    "columns",
    [[(0, 16), (24, 8)], [(0, 16), (8, 16)], [(0, 16)]],
    ids=["gap", "overlap", "one-strided-region"],
)
def test_strided_cpu_regions_that_do_not_tile_a_slab_are_refused(columns):
    slab = torch.zeros((5, 32), dtype=torch.uint8)
    with pytest.raises(LayoutError, match=r"cpu region 0 has a row stride of 32 bytes for 16-byte rows"):
        host_slabs([slab[:, a : a + w] for a, w in columns])
