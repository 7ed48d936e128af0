"""Differential: the native KeyTable (the remote residency filter's) against the reference model.

Random batches of inserts, removes and finds, with keys that share their first 8 bytes (one
bucket and tag in the reference, one probe run nowhere in the core) and the refusals of both.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from reference_core.keytable import KeyTable as RefKeyTable
from reference_core.twins import both, same

from tiered_kv.tiers.remote.residency import KeyTable

KB = 16
# Half the pool shares one 8-byte head: crafted keys, as a caller could send.
POOL = [hashlib.sha256(b"%d" % i).digest()[:KB] for i in range(16)]
POOL += [b"\x00" * 8 + hashlib.sha256(b"c%d" % i).digest()[:8] for i in range(16)]
EXAMPLES = int(os.environ.get("TIERED_KV_DIFF_EXAMPLES", "60"))


class KeyTableTwins(RuleBasedStateMachine):
    @initialize(n=st.integers(1, 20))
    def setup(self, n: int) -> None:
        self.ref, self.nat = RefKeyTable(n, KB), KeyTable(n, KB)

    @rule(data=st.data())
    def insert(self, data) -> None:
        idx = data.draw(st.lists(st.integers(0, len(POOL) - 1), max_size=6))
        slots = data.draw(st.lists(st.integers(0, self.ref.num_slots - 1), min_size=len(idx), max_size=len(idx)))
        keys = [POOL[i] for i in idx]
        both(self.ref, self.nat, lambda t: t.insert(keys, np.array(slots, dtype=np.int64)), "insert")

    @rule(data=st.data())
    def remove(self, data) -> None:
        held = [int(s) for s in np.flatnonzero(self.ref.has_key(np.arange(self.ref.num_slots)))]
        s = data.draw(st.lists(st.sampled_from(held or [0]), unique=True, max_size=5))
        both(self.ref, self.nat, lambda t: t.remove(np.array(s, dtype=np.int64)), "remove")

    @rule(idx=st.lists(st.integers(0, len(POOL) - 1), min_size=1, max_size=12))
    def find(self, idx) -> None:
        keys = [POOL[i] for i in idx]
        both(self.ref, self.nat, lambda t: t.find(keys), "find")
        both(self.ref, self.nat, lambda t: t.leading_run(keys), "leading_run")

    @invariant()
    def agree(self) -> None:
        if not hasattr(self, "ref"):
            return
        self.ref.check_invariants()
        self.nat.check_invariants()
        all_slots = np.arange(self.ref.num_slots)
        same(self.ref.has_key(all_slots), self.nat.has_key(all_slots), "has_key")
        held = all_slots[self.ref.has_key(all_slots)]
        same(self.ref.keys_of(held), self.nat.keys_of(held), "keys_of")
        same(len(self.ref), len(self.nat), "len")


TestKeyTableTwins = KeyTableTwins.TestCase
TestKeyTableTwins.settings = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
