"""The core defends its heap against what plain Python can hand it (issue 28, section 1).

Each test names one defect the review under AddressSanitizer found. Those whose failure on an
unfixed core would be a heap write run in a subprocess (same environment, so under
`make test-core-debug` the sanitizer build and its preload go along).
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import numpy as np
import pytest
from reference_core.twins import both, same_tier, tier_pair

import tiered_kv as tkv
from tiered_kv.core import core
from tiered_kv.errors import TieredKVError
from tiered_kv.manager.tier_index import READY, TierIndex
from tiered_kv.tiers.remote.residency import KeyTable

ROOT = Path(__file__).resolve().parents[2]
KB = 32


def key(i: int | str) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()[:KB]


def filled(n: int, ready: int, policy: str = "lru") -> TierIndex:
    t = TierIndex("cpu", n, KB, policy)
    if ready:
        t.commit(t.reserve([key(i) for i in range(ready)]))
    return t


def run_isolated(body: str) -> str:
    """Run a snippet in a fresh interpreter with this one's environment; its stdout, or AssertionError."""
    code = "import numpy as np\nfrom tiered_kv.manager.tier_index import TierIndex\n" + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    return r.stdout


# -- 1. views the manager exposes are read-only, and the core checks what it trusts --------------
def test_state_pins_and_key_views_are_read_only() -> None:
    t, kt = filled(4, 2), KeyTable(4, KB)
    for view in (t.state, t.pins, t.keys.slot_keys, kt.slot_keys):
        assert not view.flags.writeable
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 2
        with pytest.raises(ValueError):
            view.setflags(write=True)
    assert t.state.tolist() == [READY, READY, 0, 0] and t.pins.tolist() == [0] * 4


def test_a_state_forged_behind_the_core_is_refused_not_trusted() -> None:
    """A caller that forges READY into a FREE slot (through raw memory) gets a typed error, not a heap write."""
    out = run_isolated(
        """
        import ctypes
        from tiered_kv.errors import TieredKVError
        t = TierIndex("cpu", 4, 32)
        ctypes.c_uint8.from_address(t.state.ctypes.data + 3).value = 2  # READY, but slot 3 holds no key
        try:
            t.drop(np.array([3]))
        except TieredKVError as e:
            print("refused:", e)
        print("n_keys", t.n_keys)
        """
    )
    assert "refused: cpu: slot 3 is in state 2 but its key table disagrees" in out and "n_keys 0" in out


# -- 2. no pointer into a Python object outlives the conversion of a later argument -------------
class Clobber:
    """An iterable of keys whose iteration first runs `before` (as any Python iterator may)."""

    def __init__(self, keys: list[bytes], before) -> None:
        self.keys, self.before = keys, before

    def __iter__(self):
        self.before()
        return iter(self.keys)


def churn() -> list[bytes]:
    """Fresh bytes of the freed keys' size, so a freed key's memory is reused with other bytes."""
    return [bytes([0xEE]) * KB for _ in range(2000)]


def test_plan_store_copies_its_keys_before_converting_the_prefix() -> None:
    t = TierIndex("cpu", 8, KB)
    wanted = [key(f"k{i}") for i in range(4)]
    keys = [bytes(bytearray(k)) for k in wanted]  # objects only this list holds
    junk: list[bytes] = []
    prefix = Clobber([], lambda: (keys.clear(), junk.extend(churn())))
    new_idx, slots, *_ = t.plan_store(keys, prefix)
    assert new_idx.tolist() == [0, 1, 2, 3]
    assert t.keys_of(slots) == wanted and t.find(wanted).tolist() == slots.tolist()


def test_restore_and_insert_copy_their_keys_before_converting_the_slots() -> None:
    class Slots:  # __array__ runs Python while the slots convert, after the keys did
        def __init__(self, slots, before) -> None:
            self.slots, self.before = slots, before

        def __array__(self, dtype=None, copy=None):
            self.before()
            return np.array(self.slots, dtype=np.int64)

    wanted = [key(f"r{i}") for i in range(3)]
    for target in (TierIndex("disk", 4, KB), KeyTable(4, KB)):
        keys = [bytes(bytearray(k)) for k in wanted]
        junk: list[bytes] = []
        slots = Slots([0, 1, 2], lambda k=keys, j=junk: (k.clear(), j.extend(churn())))
        (target.restore if isinstance(target, TierIndex) else target.insert)(keys, slots)
        assert target.keys_of(np.array([0, 1, 2])) == wanted and target.find(wanted).tolist() == [0, 1, 2]


def test_reassign_copies_its_slots_before_converting_the_keys() -> None:
    """The slots are checked, then the keys' iteration rewrites them: the core must use what it checked."""
    out = run_isolated(
        """
        import hashlib
        t = TierIndex("cpu", 4, 32)
        t.commit(t.reserve([hashlib.sha256(b"%d" % i).digest() for i in range(4)]))
        victims = np.array(t.evict(1))
        class Keys:
            def __iter__(self):
                victims[0] = 1 << 40  # after the range check
                return iter([hashlib.sha256(b"new").digest()])
        t.reassign(victims, Keys())
        t.check_invariants()
        print("ok", t.n_reserved)
        """
    )
    assert "ok 1" in out


# -- 3. the slot limit is the one the core's int32 positions hold, enforced at config time -------
def test_the_slot_limit_is_the_cores_and_config_names_it() -> None:
    limit = core.MAX_SLOTS
    assert limit == (2**31 - 3) // 6  # the window's ghost pool: 6 nodes per slot + 2 sentinels, int32
    assert tkv.config.MAX_SLOTS == limit
    with pytest.raises(TieredKVError, match="MAX_SLOTS"):
        TierIndex("cpu", limit + 1, KB, "window")  # refused before it allocates anything
    with pytest.raises(TieredKVError, match="MAX_SLOTS"):
        KeyTable(limit + 1, KB)
    with pytest.raises(TieredKVError, match="MAX_SLOTS"):
        core.PolicyCore(2, limit + 1, 1, 0.0, 0.0, 0.0)
    bpb = 4096
    cfg = {"model": {"bytes_per_block": bpb}, "tiers": {"cpu": {"capacity": (limit + 1) * bpb, "allow_overcommit": True}}}
    with pytest.raises(tkv.ConfigError, match=rf"holds {limit + 1} blocks .* maximum of {limit} slots .*MAX_SLOTS"):
        tkv.load_config(cfg)


# -- 4. a repeat in one pin/unpin batch is refused (it stepped the u16 count past its check) -----
def test_pin_and_unpin_refuse_a_slot_twice_in_one_batch() -> None:
    ref, nat = tier_pair("cpu", 4, KB, "lru")
    for t in (ref, nat):
        t.commit(t.reserve([key(i) for i in range(2)]))
    for op in ("pin", "unpin"):
        both(ref, nat, lambda t, op=op: getattr(t, op)(np.array([1, 1])), op)
        assert nat.pins.tolist() == [0] * 4 and ref.pins.tolist() == [0] * 4
    nat.pin(np.array([0]))
    with pytest.raises(TieredKVError, match="unpin: slot 0 appears twice"):
        nat.unpin(np.array([0, 0]))  # it wrapped to 65535: pinned for good
    assert nat.pins[0] == 1 and nat.n_ready_pinned == 1
    nat.check_invariants()


def test_a_repeat_cannot_wrap_a_nearly_full_pin_count() -> None:
    t = filled(2, 1)
    one = np.array([0])
    for _ in range(0xFFFE):
        t.pin(one)
    with pytest.raises(TieredKVError, match="pin: slot 0 appears twice"):
        t.pin(np.array([0, 0]))
    assert t.pins[0] == 0xFFFE


# -- 5. plan_store is all or nothing -------------------------------------------------------------
def test_plan_store_refused_by_a_pin_reserves_nothing() -> None:
    t = filled(3, 2)  # slots 0, 1 READY, one free
    one = np.array([0])
    for _ in range(0xFFFF):
        t.pin(one)  # slot 0 at the most pins: pinning it as the chain's own block must refuse
    before = (t.free_count, t.n_reserved, t.n_ready, t.state.tolist())
    with pytest.raises(TieredKVError, match="concurrent pins"):
        t.plan_store([key(0), key("x"), key("y")], [])  # two new keys, one free slot: evicts, pins key(0)
    assert (t.free_count, t.n_reserved, t.n_ready, t.state.tolist()) == before
    assert t.find([key("x"), key("y")]).tolist() == [-1, -1]
    t.check_invariants()


# -- 6. the reference's ghost tag is the whole key, as the core's --------------------------------
@pytest.mark.parametrize("policy", ["arc", "window"])
def test_keys_sharing_their_first_8_bytes_are_different_ghosts(policy: str) -> None:
    a, b = b"\x07" * 8 + key("a")[8:], b"\x07" * 8 + key("b")[8:]
    ref, nat = tier_pair("t", 2, KB, policy)
    for t in (ref, nat):
        t.commit(t.reserve([a]))
        t.drop(t.evict(1))  # a is a ghost now
        t.commit(t.reserve([b]))  # b is new: seen once, not a ghost hit
    same_tier(ref, nat)
    assert nat.policy.list_sizes() == (1, 0)


# -- 7. Tier and PolicyCore cannot be copied (the policy refers into its owner) -------------------
def test_tier_and_policy_core_are_not_copyable(tmp_path: Path) -> None:
    cxx = shlex.split(sysconfig.get_config_var("CXX") or "c++")
    src = tmp_path / "nocopy.cpp"
    src.write_text(
        '#include <type_traits>\n#include "tier.hpp"\n#include "policy_core.hpp"\n'
        "using namespace tkv;\n"
        "static_assert(!std::is_copy_constructible_v<Tier> && !std::is_copy_assignable_v<Tier>);\n"
        "static_assert(!std::is_move_constructible_v<Tier>);\n"
        "static_assert(!std::is_copy_constructible_v<PolicyCore> && !std::is_copy_assignable_v<PolicyCore>);\n"
        "static_assert(!std::is_copy_constructible_v<Policy> && !std::is_copy_constructible_v<KeyTable>);\n"
    )
    r = subprocess.run([*cxx, "-std=c++17", "-fsyntax-only", "-I", str(ROOT / "native"), str(src)],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
