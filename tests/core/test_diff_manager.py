"""Differential: the TierManager over the native core against the same manager over the reference model.

Two managers (CPU + optional disk, each policy, write-through or not, staging for exclusive loads,
session protection) get the same random sequence of stores (with prefixes, repeats, failures),
spills, loads (promotions that fail or verify, exclusive ones through staging), touches, lookups,
announcements, session hints and releases. Every plan, job, lookup, event and returned key must be
equal, and after every step both tiers' states, pins, orders, cold lists and ghosts must agree.
The long run is marked slow; TIERED_KV_DIFF_EXAMPLES scales both.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from reference_core.twins import RefManager, outcome, same, same_tier

from tiered_kv.manager import TierManager

KB = 32
POOL = [hashlib.sha256(b"key%d" % i).digest() for i in range(18)]
# Keys that share their first 8 bytes: distinct keys and distinct ghosts on both sides.
POOL += [b"\x00" * 8 + hashlib.sha256(b"s%d" % i).digest()[: KB - 8] for i in range(6)]
EXAMPLES = int(os.environ.get("TIERED_KV_DIFF_EXAMPLES", "40"))
chains = st.lists(st.integers(0, len(POOL) - 1), min_size=1, max_size=8)


class ManagerTwins(RuleBasedStateMachine):
    @initialize(policy=st.sampled_from(["lru", "arc", "window"]), cpu=st.integers(2, 8),
                disk=st.sampled_from([None, 3, 6, 12]), write_through=st.booleans(),
                staging=st.sampled_from([0, 3]), protect=st.sampled_from([0.0, 0.5, 0.9]))  # fmt: skip
    def setup(self, policy, cpu, disk, write_through, staging, protect) -> None:
        kw = dict(write_through=write_through, staging_slots=staging, protect_share=protect)
        self.ref = RefManager(cpu, disk, KB, policy, **kw)
        self.nat = TierManager(cpu, disk, KB, policy, **kw)
        self.stores: list[tuple] = []  # (ref plan, native plan) not yet completed
        self.loads: list[tuple] = []
        self.sessions: set[int] = set()

    def both(self, call, where: str):
        ra, na = outcome(lambda: call(self.ref)), outcome(lambda: call(self.nat))
        assert ra[0] == na[0] and (ra[0] == "ok" or ra[1] == na[1]), f"{where}: reference {ra}, native {na}"
        if ra[0] == "ok":
            same(ra[1], na[1], where)
        return (ra[1], na[1]) if ra[0] == "ok" else (None, None)

    def spill(self, jobs, ok: list[bool]) -> None:
        rj, nj = jobs
        if rj is None:
            return
        mask = np.resize(np.array(ok or [True], dtype=bool), len(rj))
        self.both(lambda m: m.room.complete_spill(rj if m is self.ref else nj, mask), "complete_spill")

    @rule(idx=chains, pre=st.lists(st.integers(0, len(POOL) - 1), max_size=4, unique=True),
          ok=st.lists(st.booleans(), max_size=4))  # fmt: skip
    def prepare_store(self, idx, pre, ok) -> None:
        keys, prefix = [POOL[i] for i in idx], [POOL[i] for i in pre if i not in idx]
        ids = np.arange(len(keys), dtype=np.int64)
        rp, np_ = self.both(lambda m: m.stores.prepare(keys, ids, prefix), "prepare_store")
        if rp is None:
            return
        self.spill((rp.spill, np_.spill), ok)
        self.stores.append((rp, np_))

    @precondition(lambda self: self.stores)
    @rule(data=st.data(), ok=st.booleans(), spill_ok=st.lists(st.booleans(), max_size=3))
    def complete_store(self, data, ok, spill_ok) -> None:
        rp, np_ = self.stores.pop(data.draw(st.integers(0, len(self.stores) - 1)))
        jobs = self.both(lambda m: m.stores.complete(rp if m is self.ref else np_, ok), "complete_store")
        self.spill(jobs, spill_ok)

    @rule(idx=chains, max_promote=st.integers(0, 6), exclusive=st.booleans(), ok=st.lists(st.booleans(), max_size=3))
    def prepare_load(self, idx, max_promote, exclusive, ok) -> None:
        keys = [POOL[i] for i in idx]
        rp, np_ = self.both(lambda m: m.loads.prepare(keys, max_promote, exclusive=exclusive), "prepare_load")
        if rp is None:
            return
        self.spill((rp.spill, np_.spill), ok)
        self.loads.append((rp, np_))

    @precondition(lambda self: self.loads)
    @rule(data=st.data(), ok=st.lists(st.booleans(), max_size=4), corrupt=st.booleans(), abort=st.booleans())
    def finish_load(self, data, ok, corrupt, abort) -> None:
        rp, np_ = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        plan = {id(self.ref): rp, id(self.nat): np_}
        if abort and rp.promote is None and rp.restage is None:
            self.both(lambda m: m.loads.abort_load(plan[id(m)]), "abort_load")
            return
        if rp.restage is not None:
            self.both(lambda m: m.loads.complete_restage(plan[id(m)]), "complete_restage")

        def finish(m):
            p, n = plan[id(m)], len(plan[id(m)])
            if p.promote is not None:
                mask = np.resize(np.array(ok or [True], dtype=bool), len(p.promote))
                n = min(n, m.loads.complete_promote(p, mask, corrupt=corrupt))
            if p.fetch is not None:
                n = min(n, m.loads.complete_fetch(p, np.ones(len(p.fetch), dtype=bool)))
            m.loads.complete_load(p, n)
            return n

        self.both(finish, "finish_load")

    @rule(idx=chains)
    def lookup(self, idx) -> None:
        keys = [POOL[i] for i in idx]
        self.both(lambda m: m.lookup(keys), "lookup")
        self.both(lambda m: m.tiers_of(keys), "tiers_of")

    @rule(idx=chains)
    def touch(self, idx) -> None:
        self.both(lambda m: m.stores.touch([POOL[i] for i in idx]), "touch")

    @rule(idx=chains, withdraw=st.booleans())
    def announce(self, idx, withdraw) -> None:
        keys = [POOL[i] for i in idx]
        self.both(lambda m: (m.withdraw if withdraw else m.announce)(keys), "announce")

    @rule(session=st.integers(0, 3), idx=chains, protect=st.booleans())
    def hint(self, session, idx, protect) -> None:
        self.both(lambda m: m.hint(session, [POOL[i] for i in idx], protect), "hint")
        self.sessions.add(session)

    @rule(fill=chains, pinned=chains, other=chains, new=chains, ok=st.lists(st.booleans(), max_size=3))
    def protected_store_under_pins(self, fill, pinned, other, new, ok) -> None:
        """Issue 37's shape: a full tier, a load pinning blocks (left in flight), another protected
        session, then a protected session's store of new blocks: the second evict of ranking.py
        must not count the first's victims (both sides share that Python: the invariants see it)."""
        self.prepare_store(fill, [], [True])
        self.prepare_load(pinned, 0, False, [True])
        self.hint(2, other, True)
        self.hint(3, new, True)
        self.prepare_store(new, [], ok)

    @rule(session=st.integers(0, 3))
    def release(self, session) -> None:
        self.both(lambda m: m.release(session), "release")

    @rule()
    def events(self) -> None:
        self.both(lambda m: m.take_events(), "take_events")

    @invariant()
    def agree(self) -> None:
        if not hasattr(self, "ref"):
            return
        same_tier(self.ref.cpu, self.nat.cpu)
        if self.ref.disk is not None:
            same_tier(self.ref.disk, self.nat.disk)
            hist = self.ref.domain.history
            same((len(hist[0]), len(hist[1])), self.nat.domain.history_sizes(), "hierarchy history sizes")
        same(self.ref.staging_in_use, self.nat.staging_in_use, "staging in use")


class HierarchyTwins(ManagerTwins):
    """ManagerTwins with a disk tier always below a small CPU tier: one policy over both (native/domain.hpp),
    so spills, promotions of a block's history and the hierarchy's victims come up in most runs."""

    @initialize(policy=st.sampled_from(["lru", "arc", "window"]), cpu=st.integers(2, 5),
                disk=st.sampled_from([2, 4, 8]), write_through=st.booleans(),
                staging=st.sampled_from([0, 0, 3]), protect=st.sampled_from([0.0, 0.5, 0.9]))  # fmt: skip
    def setup(self, policy, cpu, disk, write_through, staging, protect) -> None:
        super().setup(policy, cpu, disk, write_through, staging, protect)
        self.stored: list[list[int]] = []

    @rule(idx=st.lists(st.integers(0, 11), min_size=1, max_size=3))
    def store_now(self, idx) -> None:
        """A store whose copies and spills land at once: blocks reach the disk and keep their rank there."""
        keys = [POOL[i] for i in idx]
        ids = np.arange(len(keys), dtype=np.int64)
        rp, np_ = self.both(lambda m: m.stores.prepare(keys, ids), "prepare_store")
        if rp is None:
            return
        self.spill((rp.spill, np_.spill), [True])
        jobs = self.both(lambda m: m.stores.complete(rp if m is self.ref else np_, True), "complete_store")
        self.spill(jobs, [True])
        self.stored.append(idx)

    @precondition(lambda self: getattr(self, "stored", None))
    @rule(data=st.data(), exclusive=st.booleans(), engine_hit=st.booleans())
    def load_stored(self, data, exclusive, engine_hit) -> None:
        """A chain stored earlier comes back: disk hits are promoted with their history, or the engine's
        own cache hit it (a held touch: history only)."""
        keys = [POOL[i] for i in data.draw(st.sampled_from(self.stored[-4:]))]
        if engine_hit:
            self.both(lambda m: m.stores.touch(keys, held=True), "touch held")
            return
        rp, np_ = self.both(lambda m: m.loads.prepare(keys, 8, exclusive=exclusive), "prepare_load")
        if rp is None:
            return
        self.spill((rp.spill, np_.spill), [True])
        plan = {id(self.ref): rp, id(self.nat): np_}

        def finish(m):
            p, n = plan[id(m)], len(plan[id(m)])
            if p.restage is not None:
                m.loads.complete_restage(p)
            if p.promote is not None:
                n = min(n, m.loads.complete_promote(p, np.ones(len(p.promote), dtype=bool)))
            m.loads.complete_load(p, n)
            return n

        self.both(finish, "finish_load")


def _settings(examples: int, steps: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])  # fmt: skip


class TestManagerTwins(ManagerTwins.TestCase):
    settings = _settings(EXAMPLES, 50)


class TestHierarchyTwins(HierarchyTwins.TestCase):
    settings = _settings(EXAMPLES, 50)


@pytest.mark.slow
class TestManagerTwinsLong(ManagerTwins.TestCase):
    settings = _settings(4 * EXAMPLES, 100)
