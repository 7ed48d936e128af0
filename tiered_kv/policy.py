"""The eviction policies the native core runs, by name, and the window policy's constants.

The tier manager (manager/tier_index.py) passes ``KINDS[name]`` and the window's shares to the core,
and the config sizes the ghosts' memory with ``GHOST_BYTES_PER_SLOT``. Standalone policy objects
over the same core (for the replay's flat simulators) live in replay/policies/.

"lru" evicts the least recently used first; "arc" is ARC (replay/policies/arc.py says how it
differs from the paper's); "window" is the adaptive-window LRU: a FIFO window for first-time blocks,
an LRU main area, ghosts steer the split.

- A block whose key is not a ghost enters the **window**, a FIFO: it stays in
  insertion order, and its first touch (its second reference) moves it to the
  most recent end of **main**, a plain LRU.
- A block whose key is a ghost (evicted, then stored again) goes straight to
  main and moves the window's target size: a ghost of the window says the
  window was too small (the target grows), a ghost of main says main was too
  small (the target shrinks).
- ``evict(n)`` takes from the window's head while the window holds more than
  its target, then from main's LRU head, and from the other area when one has
  no unpinned candidates left.
- ``demote(slots)``: a block that left because it moved up to a faster tier
  (a hit) leaves a ghost of main: it was referenced again, so when that tier
  evicts it and it is stored here once more, it goes to main, not the window.

That is ARC's structure (T1 = the window, T2 = main, B1/B2 = their ghosts), in
the native core with ARC (native/policy.hpp). What it sets differently was
measured on the Mooncake trace (flat and through the tiered cache, at 1-25 % of
its blocks), where most first-time blocks never come back and the few that do
come back thousands of references later:

- The window is small: its target starts at 10 % of the tier and stays within
  5-20 % (``low``/``high``), so one-time blocks pass through a short FIFO.
- The target moves one slot per ghost hit, per insert batch (a tag repeated in
  the batch is a hit once). ARC's ratio steps cost 0.3-1.5 points there.
- Ghosts remember far back: the window's up to 4x the tier's slots, main's up
  to 2x (``GHOSTS``), 25 bytes each, so 150 bytes per slot at the bound. Each
  list drops its own oldest.
"""

from __future__ import annotations

from .core import core

KINDS = {"lru": 0, "arc": 1, "window": 2}  # the core's policy kinds
POLICIES: tuple[str, ...] = tuple(KINDS)
START, LOW, HIGH = 0.1, 0.05, 0.2  # the window's target: initial, least, most, as shares of the tier
GHOSTS = tuple(
    core.WINDOW_GHOSTS
)  # each ghost list's bound (window's, main's), in multiples of the tier's slots
GHOST_BYTES_PER_SLOT = sum(GHOSTS) * core.GHOST_BYTES  # at the bound: the config's memory check
