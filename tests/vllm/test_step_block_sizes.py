"""KV cache groups of several block sizes (DeepSeek-V4's shape: 256-token compressed caches, 64-token windows, 4- and
8-token compressor states), packed block-outermost in one allocation, placed and viewed by vLLM's own functions and
driven through the connector's real halves (step_harness.py). A full-attention group and a sliding-window group
(window 8) with 8- and 4-token blocks, or 4- and 8-token ones: each group is keyed at its own block size, a hit ends
on a multiple of both (8 tokens), and the window group stores and loads only the blocks its window needs.
"""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("vllm.distributed.kv_transfer", reason="vLLM is not installed in this venv: run `make test-vllm`")
import torch  # noqa: E402
from packed_kv import WIDTH  # noqa: E402
from step_harness import Harness, request, store_prompt, token_values  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec  # noqa: E402

NEEDS_VLLM = True

WINDOW, UNIT = 8, 8
A = list(range(100, 120))  # 20 tokens: a hit that continues it ends at 16 (the last whole unit)
B = A[:16] + [7, 8, 9]
SHAPES = {"full8-win4": (8, 4), "full4-win8": (4, 8)}  # tokens per block: (full group, window group)


class Shape:
    def __init__(self, full_bs: int, win_bs: int) -> None:
        self.full_bs, self.win_bs = full_bs, win_bs
        self._ids = itertools.count()

    def ids(self, tokens: int) -> tuple[list[int], list[int]]:
        """Fresh block ids of both groups for a prompt (one pool: a block id is owned by one group)."""
        return tuple([next(self._ids) for _ in range(-(-tokens // bs))] for bs in (self.full_bs, self.win_bs))

    def window(self, boundary: int) -> range:
        """The window group's blocks a hit ending at token ``boundary`` reads: tokens boundary - WINDOW + 1 on."""
        return range((boundary - WINDOW + 1) // self.win_bs, boundary // self.win_bs)


def holds(h: Harness, name: str, prompt: list[int], ids: list[int], blocks: range, layer: int) -> bool:
    bs = h.layer_bs[name]
    want = token_values(prompt[blocks.start * bs : blocks.stop * bs]).reshape(len(blocks), bs, 2, WIDTH)
    return torch.equal(torch.stack([h.kv[name][ids[i]] for i in blocks]), want + layer / 4)


@pytest.fixture(params=list(SHAPES))
def rig(request, tmp_path):
    full_bs, win_bs = SHAPES[request.param]
    kw = dict(num_kv_heads=1, head_size=WIDTH, dtype=torch.float32)
    groups = [KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=full_bs, **kw)),
              KVCacheGroupSpec(["win"], SlidingWindowSpec(block_size=win_bs, sliding_window=WINDOW, **kw))]  # fmt: skip
    h = Harness(tmp_path, kv_layout="BLHNC", kv_groups=groups)  # mixed page sizes: vLLM packs them
    yield h, Shape(full_bs, win_bs)
    h.close()


def test_each_group_stores_at_its_own_block_size_only_what_a_hit_needs(rig):
    h, shape = rig
    row = h.sched.report()["stats"]["bytes_per_block"]
    assert {g["bytes_per_block"] for g in h.sched.report()["groups"]} == {row, row // 2}  # one group's pages: half
    store_prompt(h, "a", A, shape.ids(len(A)))
    c = h.counters()
    assert c["stored_full_blocks_planned"] == len(A) // shape.full_bs
    assert c["stored_sliding_blocks_planned"] == len(shape.window(16))  # the window before 16, nothing else


@pytest.mark.parametrize("computed", [0, UNIT], ids=["nothing-computed", "vllm-computed-one-unit"])
def test_a_hit_ends_on_a_multiple_of_every_block_size_and_loads_each_groups_blocks(rig, computed):
    h, shape = rig
    store_prompt(h, "a", A, shape.ids(len(A)))
    for v in h.kv.values():  # other requests' KV in every block the prompt used
        v[:] = -3.0
    ids = shape.ids(len(B))
    b = request("b", B)
    n, is_async = h.admit(b, ids, num_computed=computed)
    assert (n, is_async) == (16 - computed, True)  # several groups: loaded asynchronously (failed by request)
    for _ in range(20):
        h.step()
        if "b" in h.finished_recving:
            break
    assert "b" in h.finished_recving
    full = range(computed // shape.full_bs, 16 // shape.full_bs)  # what vLLM computed is not loaded
    assert holds(h, "full", B, ids[0], full, layer=0)
    assert computed == 0 or not holds(h, "full", B, ids[0], range(0, 1), layer=0)
    assert holds(h, "win", B, ids[1], shape.window(16), layer=1)
    assert not holds(h, "win", B, ids[1], range(0, shape.window(16).start), layer=1)  # outside the window
    h.idle()
    assert h.counters()["loaded_blocks"] == len(full) + len(shape.window(16))


def test_a_hit_needs_the_window_before_its_own_boundary(rig):
    h, shape = rig
    store_prompt(h, "a", A, shape.ids(len(A)))
    # 12 tokens: its one boundary is at 8, whose window A never stored (only the window before 16).
    assert h.admit(request("s", A[:12]), shape.ids(12))[0] == 0
    # A prompt that continues A hits at 16, not 24 (a multiple of every block size, A's last whole unit).
    longer = A + [1, 2, 3, 4, 5, 6]
    assert h.admit(request("l", longer), shape.ids(len(longer)))[0] == 16


def test_a_request_aborted_during_its_load_is_freed_by_finished_recving(rig):
    h, shape = rig
    store_prompt(h, "a", A, shape.ids(len(A)))
    b = request("b", B)
    n, is_async = h.admit(b, shape.ids(len(B)))
    assert (n, is_async) == (16, True)
    assert h.finish(b) is False  # vLLM holds a loading request's blocks itself, until finished_recving
    for _ in range(20):
        h.step()
        if "b" in h.finished_recving:
            break
    assert "b" in h.finished_recving and "b" not in h.finished_sending
    h.idle()
    assert h.admit(request("b2", B), shape.ids(len(B)))[0] == 16  # what was stored is still served
