"""Differential fuzzer, bounded in time: a CPU + disk hierarchy of the native core against the reference.

A seeded random walk calls the tiers' batch entry points directly, well-formed or not (FREE, RESERVED,
cold, pinned and outstanding slots; repeats; evictions while earlier victims are still outstanding),
as the manager never does but a direct caller can. Both sides must answer alike or refuse alike; a
refused call must change nothing (every observable is snapshotted before and compared after); both
sides pass their invariant checks whenever no victim is outstanding. It runs for
TIERED_KV_FUZZ_SECONDS (default 3) per policy: under `make test-core-debug` against the sanitizer
build, where any out-of-bounds access aborts the run.
"""

from __future__ import annotations

import hashlib
import os
import time

import numpy as np
import pytest
from reference_core.domain_tier import join_hierarchy as ref_join
from reference_core.twins import outcome, same, same_tier

from tiered_kv.manager.tier_index import FREE, READY, RESERVED, join_hierarchy

KB = 16
SECONDS = float(os.environ.get("TIERED_KV_FUZZ_SECONDS", "3"))
POOL = [hashlib.sha256(b"f%d" % i).digest()[:KB] for i in range(40)]
OPS = ("reserve", "reserve", "commit", "commit", "abort", "drop", "evict", "make_room", "settle", "settle",
       "pin", "unpin", "touch", "demote", "policy_insert", "note")  # fmt: skip


def observe(t) -> tuple:
    """Every observable of one tier (works on both sides)."""
    held = np.flatnonzero(np.asarray(t.state) != FREE)
    keys = t.keys.keys_of(held)
    return (t.free_count, np.asarray(t.free_runs()).tolist(), t.n_ready, t.n_reserved, t.n_ready_pinned, t.evictable, np.asarray(t.state).tolist(),
            np.asarray(t.pins).tolist(), list(keys), list(t.policy.order()), list(t.cold.order() if hasattr(t, "cold")
            else t.cold_order()))  # fmt: skip


def outstanding(ref) -> list[int]:
    """Victims not yet reassigned or dropped: READY slots in no list (reference side)."""
    listed = set(ref.policy.order()) | set(ref.cold.order())
    return [int(s) for s in np.flatnonzero(np.asarray(ref.state) == READY) if int(s) not in listed]


class Fuzz:
    def __init__(self, policy: str, cpu: int, disk: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        rc, rd, self.rdom = ref_join(policy, cpu, disk, KB)
        nc, nd, self.ndom = join_hierarchy(policy, cpu, disk, KB)
        self.pairs = {"cpu": (rc, nc), "disk": (rd, nd)}
        self.fresh = 0
        self.refused = 0
        self.log: list[str] = []  # the calls so far, for the failure message

    def slots(self, ref, k: int) -> np.ndarray:
        """Up to k distinct slots, any state (a repeat now and then: both must refuse it alike)."""
        n = ref.num_slots
        s = self.rng.choice(n, size=min(k, n), replace=False)
        if len(s) > 1 and self.rng.random() < 0.05:
            s[-1] = s[0]
        return s.astype(np.int64)

    def in_state(self, ref, state: int, k: int) -> np.ndarray:
        pool = np.flatnonzero(np.asarray(ref.state) == state)
        if len(pool) == 0 or self.rng.random() < 0.1:
            return self.slots(ref, k)  # mostly the right state, sometimes anything
        return self.rng.permutation(pool)[: int(self.rng.integers(1, k + 1))].astype(np.int64)

    def new_keys(self, k: int, other=None) -> list[bytes]:
        held = np.flatnonzero(np.asarray(other.state) != FREE) if other is not None else []
        if len(held) and self.rng.random() < 0.3:  # keys the other tier holds: one key on both tiers
            return other.keys.keys_of(self.rng.choice(held, size=min(k, len(held)), replace=False))
        if self.rng.random() < 0.3:
            return [POOL[int(i)] for i in self.rng.integers(0, len(POOL), k)]  # may be present or repeat
        self.fresh += k
        return [hashlib.sha256(b"n%d" % (self.fresh - i)).digest()[:KB] for i in range(k)]

    def call(self, fn, where: str):
        """fn on both sides; same outcome and answer; a refusal changes nothing on either side."""
        self.log.append(where)
        before = {name: (observe(r), observe(n)) for name, (r, n) in self.pairs.items()}
        sides = {}
        for i in (0, 1):
            sides[i] = outcome(lambda i=i: fn(i, *(p[i] for p in self.pairs.values())))
        self.log[-1] += f" {sides[1][0]}" + (f" {sides[1][1]}" if sides[1][0] == "ok" and sides[1][1] is not None else "")
        ra, na = sides[0], sides[1]
        assert ra[0] == na[0], f"{where}: reference {ra} but native {na}"
        if ra[0] == "ok":
            same(ra[1], na[1], where)
            return na[1]
        self.refused += 1
        for name, (r, n) in self.pairs.items():
            assert (observe(r), observe(n)) == before[name], f"{where}: refused but changed {name}"
        return None

    def step(self) -> None:
        r = self.rng
        op = OPS[int(r.integers(len(OPS)))]
        name = "cpu" if r.random() < 0.6 else "disk"
        ref = self.pairs[name][0]
        k = int(r.integers(1, 4))
        if op == "reserve":
            keys = self.new_keys(k, self.pairs["disk" if name == "cpu" else "cpu"][0])
            self.call(lambda i, c, d: (c, d)[name == "disk"].reserve(keys), f"{name}.reserve")
        elif op in ("commit", "abort"):
            s = self.in_state(ref, RESERVED, k)
            self.call(lambda i, c, d: getattr((c, d)[name == "disk"], op)(s), f"{name}.{op}")
        elif op == "drop":
            s = self.in_state(ref, READY, k)
            self.call(lambda i, c, d: (c, d)[name == "disk"].drop(s), f"{name}.drop")
        elif op == "evict":
            n = int(r.integers(0, 4))
            self.call(lambda i, c, d: (c, d)[name == "disk"].evict(n), f"{name}.evict")
        elif op == "make_room":
            n, spill = int(r.integers(0, 4)), bool(r.random() < 0.8)
            self.call(lambda i, c, d: c.make_room(n, spill), "cpu.make_room")
        elif op == "settle":  # outstanding victims reassigned to new keys or dropped, as a plan does
            v = np.array(outstanding(ref), dtype=np.int64)
            if not len(v):
                return
            if r.random() < 0.5:
                keys = self.new_keys(len(v))
                self.call(lambda i, c, d: (c, d)[name == "disk"].reassign(v, keys), f"{name}.reassign")
            else:
                self.call(lambda i, c, d: (c, d)[name == "disk"].drop(v), f"{name}.drop victims")
        elif op in ("pin", "unpin", "touch"):
            s = self.slots(ref, k) if r.random() < 0.3 else self.in_state(ref, READY, k)
            self.call(lambda i, c, d: getattr((c, d)[name == "disk"], op)(s), f"{name}.{op}")
        elif op == "demote":
            s, loaded = self.in_state(ref, READY, k), bool(r.random() < 0.5)
            self.call(lambda i, c, d: (c, d)[name == "disk"].demote(s, loaded=loaded), f"{name}.demote")
        elif op == "policy_insert":
            s = self.slots(ref, k)
            self.call(lambda i, c, d: (c, d)[name == "disk"].policy_insert(s), f"{name}.policy_insert")
        else:
            keys = self.new_keys(k)
            self.call(lambda i, c, d: c.note(np.frombuffer(b"".join(keys), np.uint8).reshape(-1, KB)), "note")

    def agree(self) -> None:
        for name, (r, n) in self.pairs.items():
            if outstanding(r):  # victims outstanding: the lists' check would see them, on both sides alike
                same(observe(r), observe(n), name)
            else:
                same_tier(r, n)
        same(self.rdom.size(), self.ndom.policy_len, "hierarchy policy size")


@pytest.mark.parametrize("policy", ["lru", "arc", "window"])
def test_random_calls_on_a_hierarchy_match_the_reference_and_refusals_change_nothing(policy) -> None:
    end, seed, steps, refused = time.monotonic() + SECONDS, 0, 0, 0
    while time.monotonic() < end:
        cpu, disk = (int(x) for x in np.random.default_rng(seed).integers(2, 7, 2))
        fuzz = Fuzz(policy, cpu, disk, seed)
        for i in range(200):
            try:
                fuzz.step()
                fuzz.agree()
            except Exception as e:  # an assertion, or an invariant check's error
                raise AssertionError(f"{policy} seed {seed} ({cpu} + {disk} slots), step {i}: {e!r}; "
                                     f"last calls: {fuzz.log[-8:]}") from None
        steps, refused, seed = steps + 200, refused + fuzz.refused, seed + 1
    assert steps and refused  # it ran, and refusals were exercised
