"""Copy engines (host always, cuda when a GPU is present) and copy plans."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from tiered_kv.core import core
from tiered_kv.errors import ConfigError, LayoutError, TransferError
from tiered_kv.transfer import CopyEngine, HostCopyEngine, make_engine
from tiered_kv.transfer.engines.base import Direction
from tiered_kv.transfer.engines.direct import DirectCopyEngine

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


