"""KeyTable: a dict model under random interleavings, crafted collisions, deletion, memory, errors, speed."""

from __future__ import annotations

import statistics
import time

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from reference_core.keytable import LANES, KeyTable

from tiered_kv.errors import KeyFormatError, TieredKVError


def A(*slots: int) -> np.ndarray:
    return np.array(slots, dtype=np.int64)


def random_keys(n: int, kb: int, seed: int = 0, prefix: bytes | None = None) -> list[bytes]:
    """n distinct keys; with ``prefix``, all share those first bytes (same bucket and tag)."""
    rng = np.random.default_rng(seed)
    out: dict[bytes, None] = {}
    while len(out) < n:
        raw = rng.integers(0, 256, (n, kb), dtype=np.uint8)
        if prefix is not None:
            raw[:, : len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
        out.update(dict.fromkeys(bytes(r) for r in raw))
    return list(out)[:n]


def state(t: KeyTable, pool: list[bytes]) -> tuple:
    return t.find(pool).tolist(), len(t), t.has_key(np.arange(t.num_slots)).tolist()


def model_run(held: dict[bytes, int], keys: list[bytes]) -> int:
    n = 0
    for k in keys:
        if k not in held:
            break
        n += 1
    return n


def keys_in_bucket(t: KeyTable, bucket: int, n: int, same_tag: bool, kb: int = 32) -> list[bytes]:
    """n keys with distinct first 8 bytes whose home is ``bucket``; with ``same_tag``, one 16-bit tag.

    The tag is hash bits 16..31, which depend only on the low 32 bits of the first 8 bytes: fixing those
    fixes the tag, and the high 32 bits still spread keys over buckets.
    """
    rng = np.random.default_rng(bucket)
    k0 = rng.integers(0, 2**63, 1 << 18, dtype=np.int64).view(np.uint64)
    if same_tag:
        k0 = (k0 & np.uint64(0xFFFFFFFF00000000)) | np.uint64(0x12345678)
    chosen = np.unique(k0[t._bucket(t._mix(k0)) == bucket])[:n]
    assert chosen.size == n, "search space too small for the crafted keys"
    rows = rng.integers(0, 256, (n, kb), dtype=np.uint8)
    rows[:, :8] = chosen.astype("<u8").view(np.uint8).reshape(n, 8)
    return [bytes(r) for r in rows]


# -- the dict model, under random interleavings -----------------------------------------------------
class KeyTableMachine(RuleBasedStateMachine):
    """Random insert/remove/lookup batches against a dict; refused batches must change nothing."""

    @initialize(
        kb=st.sampled_from([8, 13, 32]),
        mode=st.sampled_from(["random", "same_first8", "three_first8"]),
        num_slots=st.integers(1, 40),
        seed=st.integers(0, 2**16),
    )
    def setup(self, kb: int, mode: str, num_slots: int, seed: int) -> None:
        self.t = KeyTable(num_slots, kb)
        n = 3 * num_slots + 2
        if mode == "random" or kb == 8:
            self.pool = random_keys(n, kb, seed)
        elif mode == "same_first8":  # every key in one bucket with one tag: the worst case
            self.pool = random_keys(n, kb, seed, prefix=b"\x07" * 8)
        else:
            heads = [bytes([h]) * 8 for h in (1, 2, 3)]
            self.pool = list(
                dict.fromkeys(random_keys(1, kb, seed + i, prefix=heads[i % 3])[0] for i in range(n))
            )
        self.slot_of: dict[bytes, int] = {}
        self.key_in: dict[int, bytes] = {}

    def free_slots(self) -> list[int]:
        return [s for s in range(self.t.num_slots) if s not in self.key_in]

    @rule(data=st.data(), as_array=st.booleans())
    def insert(self, data: st.DataObject, as_array: bool) -> None:
        absent = [k for k in self.pool if k not in self.slot_of]
        free = self.free_slots()
        n = data.draw(st.integers(0, min(len(absent), len(free), 24)))
        keys = data.draw(st.permutations(absent))[:n]
        slots = data.draw(st.permutations(free))[:n]
        batch = (
            np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(n, self.t.key_bytes) if as_array else keys
        )
        self.t.insert(batch, np.array(slots, dtype=np.int64))
        for k, s in zip(keys, slots, strict=True):
            self.slot_of[k], self.key_in[s] = s, k

    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        held = sorted(self.key_in)
        slots = data.draw(st.permutations(held))[: data.draw(st.integers(0, len(held)))]
        self.t.remove(np.array(slots, dtype=np.int64))
        for s in slots:
            del self.slot_of[self.key_in.pop(s)]

    @precondition(lambda self: self.key_in)
    @rule(data=st.data())
    def refused_batches_change_nothing(self, data: st.DataObject) -> None:
        before = state(self.t, self.pool)
        held = sorted(self.key_in)
        present = self.key_in[data.draw(st.sampled_from(held))]
        absent = [k for k in self.pool if k not in self.slot_of]
        free = self.free_slots()
        with pytest.raises(TieredKVError, match="slot"):  # a key already present, into an empty slot
            self.t.insert([present], A(free[0] if free else held[0]))
        if absent:  # a new key, into a slot that holds one
            with pytest.raises(TieredKVError, match=f"slot {held[-1]}"):
                self.t.insert([absent[0]], A(held[-1]))
        if free:  # a remove that includes an empty slot forgets nothing
            with pytest.raises(TieredKVError, match=f"slot {free[0]} holds no key"):
                self.t.remove(A(held[0], free[0]))
        assert state(self.t, self.pool) == before

    @rule(data=st.data())
    def leading_run_matches_the_dict_loop(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(self.pool), max_size=12))
        held_first = sorted(self.slot_of, key=self.slot_of.get)
        for q in (keys, held_first, held_first + keys):
            assert self.t.leading_run(q) == model_run(self.slot_of, q)

    @invariant()
    def agrees_with_the_dict(self) -> None:
        if not hasattr(self, "t"):
            return
        assert self.t.find(self.pool).tolist() == [self.slot_of.get(k, -1) for k in self.pool]
        assert len(self.t) == len(self.slot_of)
        assert self.t.has_key(np.arange(self.t.num_slots)).tolist() == [
            s in self.key_in for s in range(self.t.num_slots)
        ]
        held = sorted(self.key_in)
        assert self.t.keys_of(np.array(held, dtype=np.int64)) == [self.key_in[s] for s in held]
        self.t.check_invariants()


TestKeyTableModel = KeyTableMachine.TestCase
TestKeyTableModel.settings = settings(
    max_examples=50, stateful_step_count=20, deadline=None, derandomize=True
)


# -- collisions the random model rarely reaches ---------------------------------------------------------
def test_one_batch_of_keys_sharing_their_first_8_bytes_spills_over_many_buckets() -> None:
    t = KeyTable(300, 32)
    keys = random_keys(250, 32, seed=1, prefix=b"\xab" * 8)  # one home bucket for all 250
    t.insert(keys, np.arange(250))
    t.check_invariants()
    assert t.find(keys).tolist() == list(range(250))
    assert t.leading_run(keys) == 250
    assert t._ovf.max() > 0, "the batch must have overflowed its home bucket"
    t.remove(np.arange(0, 250, 2))
    t.check_invariants()
    assert t.leading_run(keys[1::2]) == 125 and t.leading_run(keys) == 0
    assert t.find(keys).tolist() == [i if i % 2 else -1 for i in range(250)]


def test_tag_collisions_with_different_first_bytes_are_told_apart() -> None:
    t = KeyTable(64, 32)
    keys = keys_in_bucket(t, bucket=3, n=40, same_tag=True)  # one bucket, one tag, distinct first 8 bytes
    t.insert(keys[:30], np.arange(30))
    t.check_invariants()
    assert t.find(keys).tolist() == list(range(30)) + [-1] * 10
    assert t.leading_run(keys) == 30
    t.remove(np.arange(0, 30, 3))
    t.check_invariants()
    assert t.find(keys[:30]).tolist() == [-1 if i % 3 == 0 else i for i in range(30)]
    assert t.leading_run(keys[1:3] + keys[:1]) == 2


def test_overflow_wraps_from_the_last_bucket_to_the_first() -> None:
    t = KeyTable(64, 32)
    last = t._nb - 1
    keys = keys_in_bucket(t, bucket=last, n=LANES + 10, same_tag=False)
    t.insert(keys, np.arange(len(keys)))
    t.check_invariants()
    assert (t._pos[: len(keys)] // LANES == 0).sum() == 10, "10 keys must have wrapped into bucket 0"
    assert t.find(keys).tolist() == list(range(len(keys)))
    t.remove(np.arange(LANES))  # empties the home bucket; the wrapped keys stay findable
    t.check_invariants()
    assert t.find(keys[LANES:]).tolist() == list(range(LANES, len(keys)))


def test_churn_leaves_nothing_behind() -> None:
    """Deletion by overflow counts: after any churn, removing everything restores the empty table."""
    n = 4000
    t = KeyTable(n, 16)
    rng = np.random.default_rng(5)
    pool = random_keys(3 * n, 16, seed=2) + random_keys(400, 16, seed=3, prefix=b"\x01" * 8)
    slot_of = {}
    free = list(range(n))
    for step in range(25):
        drop = set(rng.permutation(sorted(slot_of.values()))[: len(slot_of) // 3].tolist())
        t.remove(np.array(sorted(drop), dtype=np.int64))
        slot_of = {k: s for k, s in slot_of.items() if s not in drop}
        free = sorted(set(range(n)) - set(slot_of.values()))
        new = [k for k in rng.permutation(len(pool)).tolist() if pool[k] not in slot_of][: len(free)]
        t.insert([pool[k] for k in new], np.array(free[: len(new)], dtype=np.int64))
        slot_of.update({pool[k]: s for k, s in zip(new, free, strict=False)})
        if step % 8 == 0:
            t.check_invariants()
    assert len(t) == n == len(slot_of)
    assert t.find(pool).tolist() == [slot_of.get(k, -1) for k in pool]
    t.check_invariants()
    t.remove(np.arange(n))
    assert len(t) == 0 and not t._ovf.any() and (t._slots == -1).all() and not t._tags.any()


def test_keys_whose_tag_is_that_of_a_free_entry() -> None:
    """Free entries carry tag 0; a key whose hash has tag 0 matches them all and must still be exact."""
    t = KeyTable(32, 16)
    k0 = np.arange(1 << 22, dtype=np.uint64)  # the tag depends on the low 32 bits: ~64 of these have tag 0
    k0 = k0[t._mix(k0).view(np.uint16)[1::4] == 0][:3]
    keys = [
        bytes(r) for r in np.c_[k0.astype("<u8").view(np.uint8).reshape(-1, 8), np.ones((3, 8), np.uint8)]
    ]
    assert t.find(keys).tolist() == [-1, -1, -1] and t.leading_run(keys) == 0
    t.insert(keys[:2], A(4, 5))
    assert t.find(keys).tolist() == [4, 5, -1] and t.leading_run(keys) == 2
    t.remove(A(4))
    assert t.find(keys).tolist() == [-1, 5, -1]
    t.check_invariants()


def test_a_freed_last_slot_is_not_a_hit() -> None:
    """A free entry holds -1, which numpy's take reads as the last row; that row's stale key must not count."""
    t = KeyTable(4, 32)
    key = random_keys(1, 32)[0]
    t.insert([key], A(3))
    t.remove(A(3))
    assert t.leading_run([key]) == 0
    assert t.find([key]).tolist() == [-1]
    t.insert([key], A(3))
    assert t.leading_run([key]) == 1


def test_leading_run_stops_at_the_first_miss() -> None:
    t = KeyTable(100, 32)
    keys = random_keys(60, 32, seed=4)
    t.insert(keys[:50], np.arange(50))
    assert t.leading_run([]) == 0
    assert t.leading_run(keys[:50]) == 50
    assert t.leading_run(keys[:20] + keys[55:56] + keys[20:40]) == 20
    assert t.leading_run(keys[50:51] + keys[:50]) == 0
    assert t.leading_run(iter(keys[:10])) == 10
    assert t.leading_run(np.frombuffer(b"".join(keys[:30]), dtype=np.uint8).reshape(30, 32)) == 30


def test_find_joined_takes_bytes_and_arrays() -> None:
    t = KeyTable(10, 16)
    keys = random_keys(6, 16, seed=6)
    t.insert(keys[:4], A(9, 8, 7, 6))
    joined = b"".join(keys)
    assert t.find_joined(joined, 6).tolist() == [9, 8, 7, 6, -1, -1]
    assert t.find_joined(np.frombuffer(joined, dtype=np.uint8), 6).tolist() == [9, 8, 7, 6, -1, -1]
    assert t.find_joined(b"", 0).tolist() == []
    with pytest.raises(KeyFormatError, match="95 bytes, expected 6 keys"):
        t.find_joined(joined[:-1], 6)


def test_slot_queries() -> None:
    t = KeyTable(8, 16)
    keys = random_keys(3, 16, seed=7)
    t.insert(keys, A(5, 0, 7))
    assert t.has_key(np.arange(8)).tolist() == [True, False, False, False, False, True, False, True]
    assert t.keys_of(A(7, 5)) == [keys[2], keys[0]] and t.key_of(0) == keys[1]
    assert t.keys_of(A()) == [] and t.find([]).dtype == np.int64
    tags = t.key_tags(A(5, 0, 7))
    assert tags.dtype == np.uint64 and len(set(tags.tolist())) == 3
    with pytest.raises(TieredKVError, match="slot 3 holds no key"):
        t.key_of(3)


# -- memory --------------------------------------------------------------------------------------------
def test_memory_per_slot_at_one_million_slots() -> None:
    t = KeyTable(1_000_000, 32)
    assert t.nbytes <= 60 * 1_000_000, f"{t.nbytes / 1e6:.1f} bytes per slot"
    assert t.nbytes >= t.slot_keys.nbytes + 8 * 1_000_000  # keys plus at least the table
    assert KeyTable(1_000_000, 16).nbytes <= 44 * 1_000_000


# -- errors --------------------------------------------------------------------------------------------
def test_wrong_keys_raise_key_format_error() -> None:
    t = KeyTable(8, 32)
    k = random_keys(4, 32, seed=8)
    t.insert(k[:2], A(0, 1))
    for call in (t.find, t.leading_run, lambda keys: t.insert(keys, np.arange(len(keys)) + 4)):
        with pytest.raises(KeyFormatError, match=r"keys\[1\] has 31 bytes, expected 32"):
            call([k[2], k[3][:31]])
        with pytest.raises(KeyFormatError, match=r"keys\[0\] must be bytes, got str"):
            call(["x" * 32])
        with pytest.raises(KeyFormatError, match="got one bytes"):
            call(k[2])
        with pytest.raises(KeyFormatError, match=r"uint8\[n, 32\]"):
            call(np.zeros((2, 16), dtype=np.uint8))
    # find checks every length; leading_run checks the total and the key that ends the run
    with pytest.raises(KeyFormatError, match=r"keys\[2\] has 33 bytes"):
        t.find([k[0], k[1], k[2] + b"x", k[3][1:]])
    with pytest.raises(KeyFormatError, match=r"keys\[2\] has 33 bytes"):
        t.leading_run([k[0], k[1], k[2] + b"x", k[3][1:]])
    assert len(t) == 2


def test_invalid_batches_raise_and_change_nothing() -> None:
    t = KeyTable(8, 16)
    k = random_keys(6, 16, seed=9)
    t.insert(k[:2], A(0, 1))
    before = state(t, k)
    cases = [
        (
            lambda: t.insert([k[2], k[0]], A(2, 3)),
            f"key {k[0].hex()} into slot 3: the key is already in slot 0",
        ),
        (lambda: t.insert([k[2], k[3]], A(2, 1)), f"slot 1, which already holds key {k[1].hex()}"),
        (lambda: t.insert([k[2], k[2]], A(2, 3)), "slots 2 and 3 in one batch"),
        (lambda: t.insert([k[2], k[3]], A(4, 4)), "slot 4 appears twice"),
        (lambda: t.insert([k[2]], A(8)), r"slot 8 is outside \[0, 8\)"),
        (lambda: t.insert([k[2]], A(-1)), "slot -1 is outside"),
        (lambda: t.insert([k[2], k[3]], A(2)), "2 keys but 1 slots"),
        (lambda: t.insert([k[2]], np.array([2.0])), "1-D integer array"),
        (lambda: t.remove(A(0, 5)), "remove: slot 5 holds no key"),
        (lambda: t.remove(A(0, 0)), "slot 0 appears twice"),
        (lambda: t.remove(np.array([[0]])), "1-D integer array"),
        (lambda: t.has_key(A(9)), "slot 9 is outside"),
    ]
    for call, message in cases:
        with pytest.raises(TieredKVError, match=message):
            call()
        assert state(t, k) == before


@pytest.mark.parametrize(
    ("num_slots", "key_bytes", "message"),
    [(0, 32, "num_slots"), (8, 7, "key_bytes"), (True, 32, "num_slots")],
)
def test_bad_geometry(num_slots: int, key_bytes: int, message: str) -> None:
    with pytest.raises(TieredKVError, match=message):
        KeyTable(num_slots, key_bytes)


def test_secrets_differ_per_instance() -> None:
    a, b = KeyTable(8, 16), KeyTable(8, 16)
    assert (a._s1, a._s2) != (b._s1, b._s2) and int(a._s2) % 2 == 1


# -- speed ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_leading_run_of_1000_keys_against_a_dict_loop() -> None:
    """Ratio measured side by side in this run; the bound is loose so a noisy machine does not flake."""
    n, kb = 1_000_000, 32
    raw = np.random.default_rng(11).integers(0, 256, (n, kb), dtype=np.uint8)
    t = KeyTable(n, kb)
    t.insert(raw, np.arange(n))
    flat = raw.tobytes()
    d = {flat[i * kb : (i + 1) * kb]: i for i in range(n)}
    query = [bytes(bytearray(flat[i * kb : (i + 1) * kb])) for i in range(400_000, 401_000)]

    def dict_loop() -> int:
        hits = 0
        for k in query:
            if k in d:
                hits += 1
            else:
                break
        return hits

    assert t.leading_run(query) == dict_loop() == 1000
    ratios = []
    for _ in range(3):  # three blocks of interleaved runs; the best block discounts a burst of load
        ours, theirs = [], []
        for _ in range(100):
            s = time.perf_counter()
            t.leading_run(query)
            ours.append(time.perf_counter() - s)
            s = time.perf_counter()
            dict_loop()
            theirs.append(time.perf_counter() - s)
        ratios.append(statistics.median(ours) / statistics.median(theirs))
    assert min(ratios) <= 2.5, f"leading_run / dict loop, per block: {[round(r, 2) for r in ratios]}"
