"""Twins for the differential tests: the same structure built on the native core and on the reference model,
and a comparison of any answer (arrays, dataclasses, tuples, exceptions) between them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from tiered_kv.errors import TieredKVError
from tiered_kv.manager import TierManager
from tiered_kv.manager.plans import Located
from tiered_kv.manager.state import TierState
from tiered_kv.manager.tier_index import TierIndex

from .domain_tier import join_hierarchy
from .tier_index import READY, RESERVED
from .tier_index import TierIndex as RefTierIndex


class RefState(TierState):
    """The manager's state over the reference tier indexes, with the pure-Python locate it had."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.fused = False  # the general paths: the fused native ones must give the same answers

    def locate(self, rows: np.ndarray) -> Located:
        n = len(rows)
        cpu_s = self.cpu.keys.find(rows)
        cpu_st = self.cpu.state[np.maximum(cpu_s, 0)]
        pending = (cpu_s >= 0) & (cpu_st == RESERVED)
        d_s = np.full(n, -1, dtype=np.int64)
        disk_ready = np.zeros(n, dtype=bool)
        rest = np.flatnonzero(cpu_s < 0)
        if self.disk is not None and len(rest):
            found = self.disk.keys.find(rows[rest])
            d_st = self.disk.state[np.maximum(found, 0)]
            d_s[rest] = found
            disk_ready[rest] = (found >= 0) & (d_st == READY)
            pending[rest] = (found >= 0) & (d_st == RESERVED)
        return Located(cpu_s, (cpu_s >= 0) & (cpu_st == READY), d_s, disk_ready, pending)


class RefManager(TierManager):
    """The TierManager's own logic over the reference tier indexes (and the pure-Python locate it had)."""

    state_type = RefState

    @staticmethod
    def new_tiers(policy: str, cpu_slots: int, disk_slots: int | None, key_bytes: int) -> tuple:
        name = TierManager.new_tiers(policy, cpu_slots, disk_slots, key_bytes)[0].policy.name  # checked, as native
        if disk_slots:  # one policy over both tiers (native/domain.hpp)
            return join_hierarchy(name, cpu_slots, disk_slots, key_bytes)
        return RefTierIndex("cpu", cpu_slots, key_bytes, name), None, None


def tier_pair(name: str, num_slots: int, key_bytes: int, policy: str) -> tuple[RefTierIndex, TierIndex]:
    return RefTierIndex(name, num_slots, key_bytes, policy), TierIndex(name, num_slots, key_bytes, policy)


def outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    """("ok", result) or ("error", the exception's family): both sides must agree on which."""
    try:
        return "ok", fn()
    except TieredKVError as e:  # SlotError, KeyFormatError, ConfigError are TieredKVErrors too
        return "error", "TieredKVError" if not isinstance(e, ValueError) else "ValueError"
    except ValueError:
        return "error", "ValueError"


def same(a: Any, b: Any, where: str = "answer") -> None:
    """Raise AssertionError naming the first difference between a reference answer and a native one."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        x, y = np.asarray(a), np.asarray(b)
        if x.size == 0 and y.size == 0:
            return
        if x.shape != y.shape or not np.array_equal(x, y):
            raise AssertionError(f"{where}: reference {x.tolist()} != native {y.tolist()}")
        return
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        if type(a) is not type(b):
            raise AssertionError(f"{where}: reference {type(a).__name__} != native {type(b).__name__}")
        for f in dataclasses.fields(a):
            same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
        return
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and not hasattr(a, "_fields"):
        if len(a) != len(b):
            raise AssertionError(f"{where}: reference has {len(a)} items, native {len(b)}: {a!r} vs {b!r}")
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
        return
    if hasattr(a, "_fields"):  # NamedTuple
        for f in a._fields:
            same(getattr(a, f), getattr(b, f), f"{where}.{f}")
        return
    if isinstance(a, float) or isinstance(b, float):
        if abs(float(a) - float(b)) > 1e-9:
            raise AssertionError(f"{where}: reference {a!r} != native {b!r}")
        return
    if a != b:
        raise AssertionError(f"{where}: reference {a!r} != native {b!r}")


def both(ref: Any, nat: Any, call: Callable[[Any], Any], where: str) -> Any:
    """Run ``call`` on both sides; same outcome and same answer, or AssertionError. Returns the native answer."""
    ra, na = outcome(lambda: call(ref)), outcome(lambda: call(nat))
    if ra[0] != na[0]:
        raise AssertionError(f"{where}: reference {ra} but native {na}")
    if ra[0] == "ok":
        same(ra[1], na[1], where)
    return na


def same_tier(ref: RefTierIndex, nat: TierIndex) -> None:
    """Every observable of one tier agrees, and both pass their own invariant checks."""
    ref.check_invariants()
    nat.check_invariants()
    for name in ("free_count", "n_ready", "n_reserved", "n_ready_pinned", "evictable", "used"):
        same(getattr(ref, name), getattr(nat, name), f"{ref.name}.{name}")
    same(ref.state, nat.state, f"{ref.name}.state")
    same(ref.free_runs(), nat.free_runs(), f"{ref.name}.free runs")
    same(ref.pins, nat.pins, f"{ref.name}.pins")
    held = np.flatnonzero(ref.state != 0)
    same(ref.keys.keys_of(held), nat.keys_of(held), f"{ref.name}.keys")
    same(ref.policy.order(), nat.policy.order(), f"{ref.name}.policy order")
    same(ref.cold.order(), nat.cold_order(), f"{ref.name}.cold order")
    if ref.policy.name != "lru":
        same(ref.policy.list_sizes(), nat.policy.list_sizes(), f"{ref.name}.list sizes")
        same(ref.policy.ghost_sizes(), nat.policy.ghost_sizes(), f"{ref.name}.ghost sizes")
        same(ref.policy.p, nat.policy.p, f"{ref.name}.p")
