"""Reference model of one policy over a CPU tier and the disk tier below it (native/domain.hpp), as plain lists.

Nodes: CPU slot s is node s, disk slot d is node split + d. T1 and T2 (LRU: T1 only) are Python lists of
nodes, oldest first; ghosts and the history are lists of tags, oldest first. Every operation is written
the obvious way (O(n) per call): the differential tests run it beside the native core on a few slots.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from tiered_kv.errors import SlotError

from .policy.window import GHOSTS, HIGH, LOW, START

T1, T2 = 1, 2
KINDS = ("lru", "arc", "window")


class Domain:
    """The hierarchy's lists, tags, ghosts and history; the tiers (domain_tier.py) keep their states and pins."""

    def __init__(self, kind: str, cpu_slots: int, disk_slots: int,
                 start: float = START, low: float = LOW, high: float = HIGH) -> None:  # fmt: skip
        self.kind = kind.lower()
        self.split = cpu_slots
        self.n = n = cpu_slots + disk_slots
        self.lists: dict[int, list[int]] = {T1: [], T2: []}
        self.tags = [0] * n
        self.ghosts: tuple[list[int], list[int]] = ([], [])
        self.history: tuple[list[int], list[int]] = ([], [])
        self.history_cap = 0 if self.kind == "lru" else n
        self.p = start * n if self.kind == "window" else 0.0
        self.low, self.high = low * n, high * n
        # node -> candidate (READY and unpinned in its tier); set by the tiers when they attach
        self.ready_unpinned: Callable[[int], bool] = lambda node: True

    # -- lists ---------------------------------------------------------------------------
    def lid(self, node: int) -> int:
        for lst, members in self.lists.items():
            if node in members:
                return lst
        return 0

    def size(self) -> int:
        return len(self.lists[T1]) + len(self.lists[T2])

    def unlink(self, node: int) -> None:
        lst = self.lid(node)
        if lst:
            self.lists[lst].remove(node)

    def replace(self, old: int, new: int) -> None:
        """Node ``new`` (in no list) takes ``old``'s place and tag: a block that moved keeps its rank."""
        members = self.lists[self.lid(old)]
        members[members.index(old)] = new
        self.tags[new] = self.tags[old]

    # -- the policy ------------------------------------------------------------------------
    def insert(self, nodes: list[int]) -> None:
        for x in nodes:
            if self.lid(x):
                raise SlotError(f"slot {x} is already tracked by the {self.kind} policy")
        if len(set(nodes)) != len(nodes):
            raise SlotError(f"slot {nodes[0]} appears twice in one insert batch")
        if self.kind == "lru":
            self.lists[T1].extend(nodes)
            return
        to_t2 = [False] * len(nodes)
        in_window = in_main = 0
        for i, x in enumerate(nodes):
            tag = self.tags[x]
            g = self._find(self.ghosts, tag)
            if g < 0:
                h = self._find(self.history, tag)
                if h >= 0:  # referenced while no tier held it: seen again -> frequent, no adaptation
                    to_t2[i] = h == 1
                    self.history[h].remove(tag)
                continue
            if self.kind == "arc":
                g1, g2 = float(len(self.ghosts[0])), float(len(self.ghosts[1]))
                if g == 0:
                    self.p = min(float(self.n), self.p + max(1.0, g2 / g1))
                else:
                    self.p = max(0.0, self.p - max(1.0, g1 / g2))
            elif g == 0:
                in_window += 1
            else:
                in_main += 1
            self.ghosts[g].remove(tag)
            to_t2[i] = True
        if self.kind == "window":
            self.p = min(self.high, max(self.low, self.p + in_window - in_main))
        for x, t2 in zip(nodes, to_t2, strict=True):
            self.lists[T2 if t2 else T1].append(x)

    def touch(self, nodes: list[int]) -> None:
        to = T1 if self.kind == "lru" else T2
        for x in nodes:
            if self.lid(x):
                self.unlink(x)
                self.lists[to].append(x)

    def select(self, n: int, candidate: Callable[[int], bool]) -> list[tuple[int, int]]:
        """The next n victims among ``candidate`` nodes, (node, list) in eviction order; [] if fewer."""
        c = lambda lst, want: [x for x in self.lists[lst] if candidate(x)][: max(want, 0)]  # noqa: E731
        if self.kind == "lru":
            out = c(T1, n)
            return [(x, T1) for x in out] if len(out) == n else []
        first = min(n, max(0, math.ceil(len(self.lists[T1]) - self.p)))
        c1 = c(T1, first)
        a = len(c1)
        c2 = c(T2, n - a)
        j2 = len(c2)
        if a + j2 < n:
            c1 = c(T1, n - j2)
            if len(c1) < n - j2:
                return []
        j1 = n - j2
        return [(x, T1) for x in c1[:a]] + [(x, T2) for x in c2] + [(x, T1) for x in c1[a:j1]]

    def evict(self, n: int, candidate: Callable[[int], bool]) -> list[int] | None:
        """Exactly n victims out of the lists (ghosts added), or None."""
        if n <= 0 or n > self.size():
            return [] if n == 0 else None
        picked = self.select(n, candidate)
        if not picked:
            return None
        for x, lst in picked:
            self.lists[lst].remove(x)
            if self.kind != "lru":
                self.add_ghost(self.tags[x], 0 if lst == T1 else 1)
        return [x for x, _ in picked]

    def evict_node(self, node: int) -> None:
        lst = self.lid(node)
        self.lists[lst].remove(node)
        if self.kind != "lru":
            self.add_ghost(self.tags[node], 0 if lst == T1 else 1)

    def order(self) -> list[int]:
        return [x for x, _ in self.select(self.size(), lambda x: True)] if self.size() else []

    # -- ghosts and history ------------------------------------------------------------------
    @staticmethod
    def _find(lists: tuple[list[int], list[int]], tag: int) -> int:
        return 0 if tag in lists[0] else 1 if tag in lists[1] else -1

    def add_ghost(self, tag: int, lst: int) -> None:
        g = self._find(self.ghosts, tag)
        if g >= 0:
            self.ghosts[g].remove(tag)
        b0, b1 = len(self.ghosts[0]), len(self.ghosts[1])
        if self.kind == "arc":
            if b0 + b1 >= self.n:
                d = b0 - b1
                self.ghosts[(0 if d >= 0 else 1) if lst == 0 else (1 if d <= 0 else 0)].pop(0)
        elif len(self.ghosts[lst]) >= GHOSTS[lst] * self.n:
            self.ghosts[lst].pop(0)
        self.ghosts[lst].append(tag)

    def note(self, tag: int) -> None:
        """A reference to a key no tier holds: seen once, or seen again if the history knew it."""
        if not self.history_cap:
            return
        h = self._find(self.history, tag)
        if h >= 0:
            self.history[h].remove(tag)
        self._push_history(1 if h >= 0 else 0, tag)

    def hot(self, tag: int) -> None:
        """A block that moved up to the engine on a hit: frequent when it comes down again."""
        if not self.history_cap:
            return
        h = self._find(self.history, tag)
        if h >= 0:
            self.history[h].remove(tag)
        self._push_history(1, tag)

    def _push_history(self, lst: int, tag: int) -> None:
        if len(self.history[0]) + len(self.history[1]) >= self.history_cap:
            self.history[0 if self.history[0] else 1].pop(0)
        self.history[lst].append(tag)
