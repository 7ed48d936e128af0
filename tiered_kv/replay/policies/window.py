"""The adaptive-window LRU as a standalone policy object (the replay's simulators); what it does: policy.py."""

from __future__ import annotations

from typing import ClassVar

from ...errors import ConfigError
from ...policy import HIGH, LOW, START
from .arc import ARCPolicy, KeyTag


def check_window(start: float, low: float, high: float) -> None:
    for name, v in (("start", start), ("low", low), ("high", high)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise ConfigError(f"window policy: {name} must be a share of the tier in [0, 1], got {v!r}")
    if not low <= start <= high:
        raise ConfigError(f"window policy: need low <= start <= high, got {low}, {start}, {high}")


class WindowPolicy(ARCPolicy):
    """The adaptive-window LRU ("window"); see the module docstring.

    ``start``, ``low``, ``high``: the window's initial, least and most target, as shares of the tier.
    ``key_tag`` as for ARCPolicy: uint64 tags of the keys slots hold, for the ghosts.
    """

    name: ClassVar[str] = "window"
    __slots__ = ()

    def __init__(self, num_slots: int, *, key_tag: KeyTag | None = None, start: float = START,
                 low: float = LOW, high: float = HIGH) -> None:  # fmt: skip
        check_window(start, low, high)
        super().__init__(num_slots, key_tag=key_tag, start=start, low=low, high=high)

    @property
    def target(self) -> float:
        """The window's target size in slots (ARC's ``p``)."""
        return self._core.p
