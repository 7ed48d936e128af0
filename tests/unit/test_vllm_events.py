"""The router's KV events: tiered_kv tier events told in vLLM's block hashes (no vLLM needed)."""

from __future__ import annotations

import pytest

from tiered_kv.integrations.vllm.events import CPU, DISK, HashBook


def _book() -> HashBook:
    book = HashBook(cap=8)
    book.remember([b"k1", b"k2", b"k3"], [b"h1", b"h2", b"h3"])
    return book


def test_store_then_spill_then_disk_eviction_in_vllm_hashes_and_forgotten_after():
    book = _book()
    assert book.translate([("stored", "cpu", [b"k1", b"k2", b"unknown"])]) == [(True, CPU, [b"h1", b"h2"])]
    # A spill moves k1 from CPU to disk: removed from one medium, stored on the other.
    assert book.translate([("spilled", "disk", [b"k1"])]) == [(False, CPU, [b"h1"]), (True, DISK, [b"h1"])]
    assert book.translate([("evicted", "disk", [b"k1"]), ("evicted", "cpu", [b"k2"])]) == [
        (False, DISK, [b"h1"]),
        (False, CPU, [b"h2"]),
    ]
    assert len(book) == 1  # k1 and k2 left every tier; k3 was queued but never stored
    assert book.translate([("stored", "cpu", [b"k1"])]) == []


def test_a_block_left_on_disk_stays_known_and_a_failed_spill_removes_the_cpu_copy():
    book = _book()
    book.translate([("stored", "cpu", [b"k1", b"k2"]), ("spilled", "disk", [b"k1"])])
    assert book.translate([("dropped", "disk", [b"k2"])]) == [(False, CPU, [b"h2"])]
    assert book.translate([("evicted", "cpu", [b"k1"])]) == []  # its CPU copy was already reported gone
    assert book.translate([("evicted", "disk", [b"k1"])]) == [(False, DISK, [b"h1"])]


def test_the_book_is_bounded_oldest_first():
    book = HashBook(cap=2)
    book.remember([b"a", b"b", b"c"], [1, 2, 3])
    assert len(book) == 2
    assert book.translate([("stored", "cpu", [b"a", b"b", b"c"])]) == [(True, CPU, [2, 3])]


def test_to_vllm_events_builds_vllm_objects():
    pytest.importorskip("vllm.distributed.kv_events")
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from tiered_kv.integrations.vllm.events import to_vllm_events

    stored, removed = to_vllm_events([(True, CPU, [b"h1"]), (False, DISK, [b"h1"])], block_size=16)
    assert isinstance(stored, BlockStored) and stored.medium == "CPU" and stored.block_hashes == [maybe_convert_block_hash(b"h1")]
    assert isinstance(removed, BlockRemoved) and removed.medium == "STORAGE"
