"""Differential: one tier of the native core against the reference model, under random batch operations.

A hypothesis state machine applies the same operation to both (reserve, reassign, commit, abort,
drop, evict, demote, pin, unpin, touch, find) under each policy, requires the same answer or the
same refusal, and after every step compares every observable: states, pins, counters, keys, the
policy's order and lists, its ghosts and target, the cold list, and both sides' own invariants.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from reference_core.twins import both, same, same_tier, tier_pair
from test_diff_fuzz import observe, outstanding

KB = 16
POOL = [hashlib.sha256(b"k%d" % i).digest()[:KB] for i in range(32)]
# Keys that share their first 8 bytes: distinct keys and distinct ghosts on both sides.
POOL += [b"\x00" * 8 + hashlib.sha256(b"s%d" % i).digest()[: KB - 8] for i in range(8)]
EXAMPLES = int(os.environ.get("TIERED_KV_DIFF_EXAMPLES", "60"))


class TierTwins(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["lru", "arc", "window"]), n=st.integers(1, 12))
    def setup(self, policy: str, n: int) -> None:
        self.ref, self.nat = tier_pair("t", n, KB, policy)
        self.fresh = 0

    def slots(self, state: int | None = None) -> list[int]:
        st_ = self.ref.state
        return [int(s) for s in np.flatnonzero(st_ == state)] if state is not None else list(range(len(st_)))

    def do(self, call, where: str):
        """Same answer or same refusal; a refused call changes nothing on either side."""
        before = observe(self.ref), observe(self.nat)
        got = both(self.ref, self.nat, call, where)
        if got[0] == "error":
            assert (observe(self.ref), observe(self.nat)) == before, f"{where}: refused but changed the tier"
        return got

    @rule(idx=st.lists(st.integers(0, len(POOL) - 1), max_size=8))
    def reserve(self, idx: list[int]) -> None:
        keys = [POOL[i] for i in idx]  # may repeat, may be present: both must refuse alike
        self.do(lambda t: t.reserve(np.frombuffer(b"".join(keys), np.uint8).reshape(-1, KB) if keys else keys), "reserve")

    @rule(data=st.data())
    def commit(self, data) -> None:
        s = data.draw(st.permutations(self.slots(1)))
        k = data.draw(st.integers(0, len(s)))
        self.do(lambda t: t.commit(np.array(s[:k], dtype=np.int64)), "commit")

    @rule(data=st.data(), wrong=st.booleans())
    def abort(self, data, wrong: bool) -> None:
        pool = self.slots(2 if wrong else 1)  # wrong: READY slots, refused by both
        s = data.draw(st.lists(st.sampled_from(pool), unique=True, max_size=4)) if pool else []
        self.do(lambda t: t.abort(np.array(s, dtype=np.int64)), "abort")

    @rule(data=st.data())
    def drop(self, data) -> None:
        pool = self.slots(2)
        s = data.draw(st.lists(st.sampled_from(pool), unique=True, max_size=4)) if pool else []
        self.do(lambda t: t.drop(np.array(s, dtype=np.int64)), "drop")

    @rule(n=st.integers(0, 6), reuse=st.booleans())
    def evict(self, n: int, reuse: bool) -> None:
        kind, victims = self.do(lambda t: t.evict(n), "evict")
        same(self.ref.evicted_cold, self.nat.evicted_cold, "evicted_cold")
        if kind == "error" or not len(victims):
            return
        if reuse:  # victims go to new keys (eviction for a store), else they are dropped
            keys = [hashlib.sha256(b"new%d" % (self.fresh + i)).digest()[:KB] for i in range(len(victims))]
            self.fresh += len(victims)
            self.do(lambda t: t.reassign(victims, keys), "reassign")
        else:
            self.do(lambda t: t.drop(victims), "drop victims")

    @rule(data=st.data(), loaded=st.booleans())
    def demote(self, data, loaded: bool) -> None:
        pool = self.slots()
        s = data.draw(st.lists(st.sampled_from(pool), unique=True, max_size=5))
        self.do(lambda t: t.demote(np.array(s, dtype=np.int64), loaded=loaded), "demote")

    @rule(data=st.data())
    def pin(self, data) -> None:
        pool = self.slots(2) + self.slots(1)  # what the manager pins: servable or arriving blocks
        if data.draw(st.booleans()):
            pool = self.slots()  # FREE slots too: both refuse them
        s = data.draw(st.lists(st.sampled_from(pool), unique=True, max_size=4)) if pool else []
        self.do(lambda t: t.pin(np.array(s, dtype=np.int64)), "pin")

    @rule(data=st.data())
    def unpin(self, data) -> None:
        held = [int(x) for x in np.flatnonzero(self.ref.pins)]
        s = data.draw(st.lists(st.sampled_from(held or [0]), unique=True, max_size=4))
        self.do(lambda t: t.unpin(np.array(s, dtype=np.int64)), "unpin")

    @precondition(lambda self: self.ref.n_ready > 0)
    @rule(data=st.data())
    def touch(self, data) -> None:
        s = data.draw(st.lists(st.sampled_from(self.slots(2)), max_size=6))  # repeats: the last one wins
        self.do(lambda t: t.touch(np.array(s, dtype=np.int64)), "touch")

    @rule(idx=st.lists(st.integers(0, len(POOL) - 1), max_size=10))
    def find(self, idx: list[int]) -> None:
        keys = [POOL[i] for i in idx]
        self.do(lambda t: t.find_ready(keys) if keys else np.empty(0, np.int64), "find_ready")
        if keys:
            self.do(lambda t: t.find(keys), "find")

    @rule(idx=st.lists(st.integers(0, len(POOL) - 1), max_size=8),
          pre=st.lists(st.integers(0, len(POOL) - 1), max_size=3, unique=True))  # fmt: skip
    def plan_store(self, idx: list[int], pre: list[int]) -> None:
        """The fused prepare_store: refused alike (victims outstanding) and then changing nothing."""
        keys, prefix = [POOL[i] for i in idx], [POOL[i] for i in pre]
        self.do(lambda t: t.plan_store(keys, prefix), "plan_store")

    @rule(n=st.integers(1, 6), idx=st.lists(st.integers(0, len(POOL) - 1), min_size=1, max_size=8))
    def plan_store_while_held(self, n: int, idx: list[int]) -> None:
        """Victims outstanding, then a plan_store that must evict: its evict counts them and refuses,
        and the reservation it made first must go back (checked in do)."""
        self.do(lambda t: t.evict(n), "evict (held)")
        self.plan_store(idx, [])

    @rule(n=st.integers(1, 6))
    def evict_and_hold(self, n: int) -> None:
        """Victims left outstanding (still READY and counted evictable): a later evict that counts
        them refuses alike on both sides, and changes nothing (checked in do)."""
        self.do(lambda t: t.evict(n), "evict (held)")
        same(self.ref.evicted_cold, self.nat.evicted_cold, "evicted_cold")

    @rule(data=st.data(), reuse=st.booleans())
    def settle(self, data, reuse: bool) -> None:
        """Outstanding victims reassigned or dropped, as a plan does (some may have been pinned since)."""
        held = outstanding(self.ref)
        if not held:
            return
        v = np.array(sorted(data.draw(st.lists(st.sampled_from(held), unique=True, min_size=1))), dtype=np.int64)
        if reuse:
            keys = [hashlib.sha256(b"held%d" % (self.fresh + i)).digest()[:KB] for i in range(len(v))]
            self.fresh += len(v)
            self.do(lambda t: t.reassign(v, keys), "reassign held")
        else:
            self.do(lambda t: t.drop(v), "drop held")

    @invariant()
    def agree(self) -> None:
        if not hasattr(self, "ref"):
            return
        if outstanding(self.ref):  # the lists' invariant sees outstanding victims, on both sides alike
            same(observe(self.ref), observe(self.nat), "tier")
        else:
            same_tier(self.ref, self.nat)


TestTierTwins = TierTwins.TestCase
TestTierTwins.settings = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
