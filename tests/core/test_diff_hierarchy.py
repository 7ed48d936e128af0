"""Differential: one policy over CPU + disk (native/domain.hpp) against the reference (reference_core/domain.py).

A seeded random walk per policy and size drives both managers with the calls that move blocks through the
hierarchy: stores whose copies and spills land late and out of order (a block in flight down keeps its rank),
promotions of disk hits (their history goes with them), exclusive loads, the engine's own hits
(``touch(held=True)``: history only), touches, session hints and releases. After every step both tiers'
orders, cold lists, list sizes, ghosts, the window's target and the history must agree. The hypothesis
machines in test_diff_manager.py cover the rest of the manager with and without a disk tier.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
from reference_core.twins import RefManager, outcome, same, same_tier

from tiered_kv.manager import TierManager

KB = 32
POOL = [hashlib.sha256(b"key%d" % i).digest() for i in range(14)]

STEPS = int(os.environ.get("TIERED_KV_DIFF_EXAMPLES", "40")) * 15
OPS = ("store", "store", "land", "land", "spill", "load", "load", "held", "touch", "hint", "release", "lookup")


class Walk:
    def __init__(self, policy: str, cpu: int, disk: int, write_through: bool, protect: float, seed: int) -> None:
        kw = dict(write_through=write_through, protect_share=protect)
        self.ref, self.nat = RefManager(cpu, disk, KB, policy, **kw), TierManager(cpu, disk, KB, policy, **kw)
        self.rng = np.random.default_rng(seed)
        self.stores: list[tuple] = []  # (ref plan, native plan) whose copies have not landed
        self.spills: list[tuple] = []  # (ref job, native job) in flight to the disk
        self.chains: list[list[bytes]] = []

    def both(self, call, where: str):
        ra, na = outcome(lambda: call(self.ref)), outcome(lambda: call(self.nat))
        assert ra[0] == na[0] and (ra[0] == "ok" or ra[1] == na[1]), f"{where}: reference {ra}, native {na}"
        if ra[0] == "ok":
            same(ra[1], na[1], where)
        return (ra[1], na[1]) if ra[0] == "ok" else (None, None)

    def pick(self, seq):
        return seq.pop(int(self.rng.integers(len(seq))))

    def chain(self) -> list[bytes]:
        if self.chains and self.rng.random() < 0.6:
            return self.chains[-1 - int(self.rng.integers(min(4, len(self.chains))))]
        n = int(self.rng.integers(1, 5))
        return [POOL[int(i)] for i in self.rng.integers(0, 14, n)]

    def queue_spill(self, jobs) -> None:
        if jobs[0] is not None:
            self.spills.append(jobs)

    def step(self) -> None:
        op = OPS[int(self.rng.integers(len(OPS)))]
        r = self.rng
        if op == "store":
            keys = self.chain()
            ids = np.arange(len(keys), dtype=np.int64)
            rp, np_ = self.both(lambda m: m.stores.prepare(keys, ids), "prepare_store")
            if rp is not None:
                self.queue_spill((rp.spill, np_.spill))
                self.stores.append((rp, np_))
                self.chains.append(keys)
        elif op == "land" and self.stores:
            rp, np_ = self.pick(self.stores)
            ok = bool(r.random() < 0.9)
            self.queue_spill(self.both(lambda m: m.stores.complete(rp if m is self.ref else np_, ok), "complete_store"))
        elif op == "spill" and self.spills:
            rj, nj = self.pick(self.spills)
            mask = r.random(len(rj)) < 0.9
            self.both(lambda m: m.room.complete_spill(rj if m is self.ref else nj, mask), "complete_spill")
        elif op == "load":
            keys, exclusive = self.chain(), bool(r.random() < 0.3)
            rp, np_ = self.both(lambda m: m.loads.prepare(keys, 8, exclusive=exclusive), "prepare_load")
            if rp is None:
                return
            self.queue_spill((rp.spill, np_.spill))
            ok = r.random(len(rp.promote)) < 0.9 if rp.promote is not None else None
            plan = {id(self.ref): rp, id(self.nat): np_}

            def finish(m):
                p, n = plan[id(m)], len(plan[id(m)])
                if p.restage is not None:
                    m.loads.complete_restage(p)
                if p.promote is not None:
                    n = min(n, m.loads.complete_promote(p, ok))
                m.loads.complete_load(p, n)
                return n

            self.both(finish, "finish_load")
        elif op == "held":
            keys = self.chain()
            self.both(lambda m: m.stores.touch(keys, held=True), "touch held")
        elif op == "touch":
            keys = self.chain()
            self.both(lambda m: m.stores.touch(keys), "touch")
        elif op == "hint":
            keys, session, protect = self.chain(), int(r.integers(3)), bool(r.random() < 0.5)
            self.both(lambda m: m.hint(session, keys, protect), "hint")
        elif op == "release":
            session = int(r.integers(3))
            self.both(lambda m: m.release(session), "release")
        else:
            keys = self.chain()
            self.both(lambda m: m.lookup(keys), "lookup")
        self.both(lambda m: m.take_events(), "take_events")

    def agree(self) -> None:
        same_tier(self.ref.cpu, self.nat.cpu)
        same_tier(self.ref.disk, self.nat.disk)
        hist = self.ref.domain.history
        same((len(hist[0]), len(hist[1])), self.nat.domain.history_sizes(), "hierarchy history sizes")


@pytest.mark.parametrize("policy", ["lru", "arc", "window"])
@pytest.mark.parametrize("cpu,disk,write_through,protect", [(3, 5, False, 0.0), (4, 8, True, 0.0), (2, 3, False, 0.5)])
def test_one_policy_over_cpu_and_disk_matches_the_reference(policy, cpu, disk, write_through, protect) -> None:
    for seed in range(3):
        walk = Walk(policy, cpu, disk, write_through, protect, seed)
        for i in range(STEPS):
            try:
                walk.step()
                walk.agree()
            except AssertionError as e:
                raise AssertionError(f"seed {seed}, step {i}: {e}") from None
