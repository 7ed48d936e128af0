"""The raw references are checked before they are trusted, and a suspect figure shows in the table."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rich.console import Console

from tiered_kv.bench.raw import Batch, RawCopies
from tiered_kv.bench.render import render
from tiered_kv.bench.rig import engine_tensors
from tiered_kv.bench.stats import compare
from tiered_kv.errors import TieredKVError


def _rig(regions: int = 4, block_bytes: int = 256, rows: int = 32) -> RawCopies:
    gpu = engine_tensors(block_bytes, regions, rows, "cpu")
    slab = torch.zeros((rows, block_bytes), dtype=torch.uint8)
    width = block_bytes // regions
    return RawCopies(gpu, slab, [r * width for r in range(regions)], batch=8)


def test_every_raw_candidate_copies_the_right_bytes_both_ways():
    raw = _rig()
    b = Batch.of(np.array([5, 0, 31, 7, 2, 9, 30, 11]), torch.device("cpu"))
    assert set(raw.checked("store", b, 8)) == set(raw.store_candidates())
    assert raw.holds(np.arange(8, 16), b)
    assert not raw.holds(np.arange(0, 8), b)
    assert set(raw.checked("load", b, 16)) == set(raw.load_candidates())


class _WrongStore(RawCopies):
    def store_candidates(self):
        good = super().store_candidates()

        def off_by_one(b: Batch, first: int) -> None:  # lands one row too low
            good["numpy gather"](b, first + 1)

        return {**good, "off by one": off_by_one}


def test_a_raw_candidate_that_copies_wrong_bytes_is_refused():
    gpu = engine_tensors(256, 4, 32, "cpu")
    raw = _WrongStore(gpu, torch.zeros((32, 256), dtype=torch.uint8), [0, 64, 128, 192], batch=8)
    b = Batch.of(np.arange(8) * 3, torch.device("cpu"))
    with pytest.raises(TieredKVError, match="off by one"):
        raw.checked("store", b, 0)


def _row(op: str, raw_s: list[float], ours_s: list[float]) -> dict:
    return {"op": op, "block_bytes": 16 << 10, "regions": 8, "raw_method": "numpy.take(out=)",
            **compare(raw_s, ours_s, 1 << 20)}  # fmt: skip


def test_the_table_flags_a_raw_reference_slower_than_ours():
    result = {
        "meta": {"batch_blocks": 64, "torch_threads": 1, "cpus": 2, "seconds": 1.0},
        "cache": [_row("store", [1.0] * 9, [1.1] * 9), _row("load", [3.0] * 9, [1.0] * 9)],
    }
    console = Console(record=True, width=200)
    render(result, console)
    text = console.export_text()
    assert "store 16K x8" in text and "load 16K x8" in text
    assert "warning: cache load 16K x8: raw reference slower than ours (median ratio 3.00" in text
    assert "warning: cache store" not in text
