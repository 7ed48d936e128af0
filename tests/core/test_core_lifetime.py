"""The core's objects are freed when their Python owners go, and the views they hand out outlive them.

A tier's state, pins and key views are numpy arrays, which the cyclic GC does not traverse: a view
whose base was the tier itself, stored on that tier (TierIndex.state), made a cycle the GC could not
see, so no tier, hierarchy or key table was ever freed. The views now share the storage instead.
"""

from __future__ import annotations

import gc
import hashlib
import weakref

from test_core_hardening import run_isolated

from tiered_kv.manager.tier_index import READY, TierIndex, join_hierarchy
from tiered_kv.tiers.remote.residency import KeyTable

KB = 32


def keys(prefix: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{prefix}{i}".encode()).digest()[:KB] for i in range(n)]


def dead(*refs: weakref.ref) -> bool:
    gc.collect()
    return all(r() is None for r in refs)


def test_a_dropped_tier_is_freed() -> None:
    t = TierIndex("cpu", 64, KB)
    t.commit(t.reserve(keys("a", 8)))
    ref = weakref.ref(t)
    del t
    assert dead(ref)


def test_a_dropped_hierarchy_frees_both_tiers_and_the_domain() -> None:
    cpu, disk, domain = join_hierarchy("arc", 16, 32, KB)
    cpu.commit(cpu.reserve(keys("c", 4)))
    disk.commit(disk.reserve(keys("d", 4)))
    refs = weakref.ref(cpu), weakref.ref(disk), weakref.ref(domain)
    del cpu, disk, domain
    assert dead(*refs)


def test_a_dropped_key_table_is_freed() -> None:
    kt = KeyTable(64, KB)
    kt.insert(keys("k", 3), [0, 5, 9])
    ref = weakref.ref(kt)
    del kt
    assert dead(ref)


def test_a_held_view_does_not_keep_its_tier_alive() -> None:
    t = TierIndex("cpu", 64, KB)
    views = t.state, t.pins, t.keys.slot_keys
    ref = weakref.ref(t)
    del t
    assert dead(ref)
    assert all(not v.flags.writeable for v in views)


def test_views_stay_valid_after_their_owners_are_freed() -> None:
    # In a subprocess: under `make test-core-debug` a read of freed storage is an ASan abort there.
    # tobytes() copies with memcpy (intercepted by ASan); find() reads the rows in the core itself.
    out = run_isolated(f"""
        import gc, hashlib, weakref
        from tiered_kv.tiers.remote.residency import KeyTable
        from tiered_kv.manager.tier_index import join_hierarchy
        ks = [hashlib.sha256(b"%d" % i).digest()[:{KB}] for i in range(300)]
        cpu, disk, domain = join_hierarchy("arc", 1024, 2048, {KB})
        s = cpu.reserve(ks); cpu.commit(s); cpu.pin(s[:7])
        d = disk.reserve([k[::-1] for k in ks]); disk.commit(d)
        kt = KeyTable(512, {KB}); kt.insert(ks[:50], np.arange(50))
        views = [cpu.state, cpu.pins, cpu.keys.slot_keys, disk.state, disk.keys.slot_keys, kt.slot_keys]
        before = [v.tobytes() for v in views]
        refs = [weakref.ref(o) for o in (cpu, disk, domain, kt)]
        del cpu, disk, domain, kt, s, d
        gc.collect()
        assert all(r() is None for r in refs), "an owner outlived its drop"
        churn = [TierIndex("x", 2048, {KB}) for _ in range(8)]  # reuse what was freed
        for t in churn:
            t.commit(t.reserve([k[1:] + b"x" for k in ks]))
        assert [v.tobytes() for v in views] == before
        probe = TierIndex("probe", 1024, {KB})
        probe.commit(probe.reserve(views[2][:300]))  # the core reads the orphaned key rows
        assert probe.n_ready == 300 and (probe.find(views[5][:50]) >= 0).all()
        assert int((views[0] == {READY}).sum()) == 300 and int(views[1].sum()) == 7
        print("ok")
    """)
    assert out.strip() == "ok"
