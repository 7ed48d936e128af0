"""Copy engines (host always, cuda when a GPU is present) and copy plans."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_kv.errors import ConfigError, LayoutError, TransferError
from tiered_kv.transfer import CopyEngine, HostCopyEngine, make_engine, plan_copy
from tiered_kv.transfer.bridge import EventBridge
from tiered_kv.transfer.cuda import Staging, enqueue_load, enqueue_store
from tiered_kv.transfer.plan import (
    GatherRun,
    GatherScatter,
    ScatterRun,
    SliceCopy,
    build_plan,
    dst_runs,
    spans,
    src_runs,
)

BLOCK_BYTES = (4096, 300, 64)
NUM_BLOCKS = 40
NUM_SLOTS = 32
ENGINES = ["host", pytest.param("cuda", marks=pytest.mark.gpu)]


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
    engine = make_engine(request.param, gpu, cpu)
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


@pytest.mark.parametrize("kind", ENGINES)
async def test_cancelling_the_waiter_does_not_cancel_the_copy(kind):
    # 1 MiB blocks so the copy is still running when the waiter is cancelled.
    gpu, cpu = make_regions(kind, block_bytes=(1 << 20,), num_blocks=24, num_slots=24)
    gpu_before = snapshot(gpu)
    gpu_ids, slots = list(range(23, -1, -1)), list(range(24))
    async with make_engine(kind, gpu, cpu) as engine:
        handle = engine.submit_store(gpu_ids, slots)

        async def waiter():
            await handle

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0)  # the task is now awaiting the handle
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not handle.future.cancelled()
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


async def test_copy_failure_fails_the_future_with_transfer_error():
    # An expanded (stride-0) destination makes the copy kernel itself raise.
    gpu = [torch.zeros((1, 64), dtype=torch.uint8).expand(8, 64)]
    cpu = [torch.ones((8, 64), dtype=torch.uint8)]
    async with HostCopyEngine(gpu, cpu) as engine:
        handle = engine.submit_load([0, 1, 2], [4, 1, 6])
        with pytest.raises(TransferError, match="load of 3 blocks failed") as info:
            await handle
        assert isinstance(info.value.__cause__, RuntimeError)
        assert engine.inflight == 0
        await engine.submit_store([0], [0])  # the engine keeps working afterwards


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


# -- plans -----------------------------------------------------------------


def test_plan_fast_paths():
    assert build_plan([4, 5, 6], [0, 1, 2]).ops == (SliceCopy(4, 0, 3),)
    assert build_plan([9, 2, 5], [0, 1, 2]).ops == (GatherRun((9, 2, 5), 0),)
    assert build_plan([0, 1, 2], [9, 2, 5]).ops == (ScatterRun(0, (9, 2, 5)),)
    assert build_plan([], []).ops == ()


def test_plan_uses_runs_when_few():
    # two dst runs (0..2 and 10..11), src scattered
    plan = build_plan([7, 3, 9, 1, 5], [0, 1, 2, 10, 11], bytes_per_block=4096)
    assert plan.strategy == "dst_runs"
    assert plan.ops == (GatherRun((7, 3, 9), 0), GatherRun((1, 5), 10))
    # two src runs, dst scattered
    plan = build_plan([0, 1, 2, 20, 21], [9, 4, 6, 1, 30], bytes_per_block=4096)
    assert plan.ops == (ScatterRun(0, (9, 4, 6)), ScatterRun(20, (1, 30)))


def test_plan_scattered_small_blocks_gather_scatter_big_blocks_per_row():
    src, dst = [8, 1, 6, 3], [5, 0, 9, 2]
    assert build_plan(src, dst, bytes_per_block=1024).strategy == "gather_scatter"
    big = build_plan(src, dst, bytes_per_block=8 << 20)
    assert big.strategy == "dst_runs" and all(isinstance(op, SliceCopy) for op in big.ops)


def test_plan_hybrid_keeps_long_runs_as_slices():
    src = [10, 11, 12, 13, 40, 3, 27, 33, 19, 1]
    dst = [0, 1, 2, 3, 17, 9, 30, 25, 6, 13]
    plan = build_plan(src, dst, bytes_per_block=32 * 1024)
    assert plan.strategy == "hybrid"
    assert plan.ops == (SliceCopy(10, 0, 4), GatherScatter((19, 3, 1, 40, 33, 27), (6, 9, 13, 17, 25, 30)))
    assert plan.calls == 3


def test_runs_and_spans():
    assert [r.src for r in src_runs([0, 0, 1, 1], [3, 4, 5, 6])] == [(0, 1), (0, 1)]
    assert [r.dst for r in dst_runs([5, 6, 9], [2, 0, 1])] == [(0, 1, 2)]
    assert spans([4, 5, 6, 9, 10, 2]) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]


def test_plan_copy_validates():
    with pytest.raises(TransferError, match="duplicate dst id 2"):
        plan_copy([0, 1], [2, 2], src_len=4, dst_len=4)
    with pytest.raises(TransferError, match="src id 4 out of range"):
        plan_copy([4], [0], src_len=4, dst_len=4)


@st.composite
def copies(draw):
    src_len = draw(st.integers(1, 24))
    dst_len = draw(st.integers(1, 24))
    n = draw(st.integers(0, dst_len))
    dst = draw(st.permutations(range(dst_len)))[:n]
    src = draw(st.lists(st.integers(0, src_len - 1), min_size=n, max_size=n))
    row_bytes = draw(st.sampled_from([1, 3, 8, 12, 64]))
    bytes_per_block = draw(st.sampled_from([0, 16, 4096, 1 << 22]))
    return src, dst, src_len, dst_len, row_bytes, bytes_per_block


@settings(max_examples=300, deadline=None)
@given(copies())
def test_plan_equals_naive_per_row_copy(case):
    src_ids, dst_ids, src_len, dst_len, row_bytes, bytes_per_block = case
    gen = torch.Generator().manual_seed(len(src_ids))
    srcs = [torch.randint(0, 256, (src_len, row_bytes), dtype=torch.uint8, generator=gen) for _ in range(2)]
    dsts = [torch.randint(0, 256, (dst_len, row_bytes), dtype=torch.uint8, generator=gen) for _ in range(2)]
    expected = [d.clone() for d in dsts]
    for s, d in zip(srcs, expected, strict=True):
        for i, j in zip(src_ids, dst_ids, strict=True):
            d[j] = s[i]
    plan = plan_copy(
        src_ids, dst_ids, src_len=src_len, dst_len=dst_len, bytes_per_block=bytes_per_block, regions=2
    )
    plan.apply(srcs, dsts)
    assert all(torch.equal(a, b) for a, b in zip(dsts, expected, strict=True))


# -- the CUDA engine's enqueue logic, driven with CPU tensors ------------------


@settings(max_examples=150, deadline=None)
@given(copies(), st.sampled_from([1, 100, 4096, 1 << 30]), st.booleans())
def test_cuda_enqueue_logic_matches_naive_copy(case, staging_limit, store):
    # Same functions the CUDA engine queues on its stream; on CPU tensors the
    # non_blocking copies are synchronous, so the result can be checked at once.
    src_ids, dst_ids, src_len, dst_len, row_bytes, _ = case
    gen = torch.Generator().manual_seed(len(src_ids))
    srcs = [torch.randint(0, 256, (src_len, b), dtype=torch.uint8, generator=gen) for b in (row_bytes, 40)]
    dsts = [torch.randint(0, 256, (dst_len, b), dtype=torch.uint8, generator=gen) for b in (row_bytes, 40)]
    expected = [d.clone() for d in dsts]
    for s, d in zip(srcs, expected, strict=True):
        for i, j in zip(src_ids, dst_ids, strict=True):
            d[j] = s[i]
    staging = Staging(torch.device("cpu"), staging_limit)

    def index(ids):
        return torch.tensor(ids, dtype=torch.int64)

    if store:  # src = gpu blocks, dst = cpu slots
        enqueue_store(srcs, dsts, src_ids, dst_ids, staging, index)
    else:  # src = cpu slots, dst = gpu blocks
        enqueue_load(dsts, srcs, src_ids, dst_ids, staging, index)
    assert all(torch.equal(a, b) for a, b in zip(dsts, expected, strict=True))
