"""``--capacity-share F``: size the replay's tiers as a share of the workload's unique blocks.

The split (documented in ``tiered-kv replay --help`` and the README):

* total = round(F * unique blocks)
* GPU   = max(longest request in blocks, 10 % of total): the GPU must hold a whole
  request, or the emulator cuts it and counts the rest as misses
* CPU   = 25 % of total, but at most what the GPU leaves less one block, so the disk
  keeps at least one (this only bites at small shares of a trace with long
  requests: 1 % of the Mooncake trace is 439 blocks, its longest request 374)
* disk  = the rest

GPU + CPU + disk == total always, and CPU and disk get at least one block each;
a share too small for that is a ConfigError naming the share, the unique count
and the longest request. Percentages round half up, in integers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ..errors import ConfigError
from .trace import Request

__all__ = ["SHARE_SPLIT_HELP", "TierSplit", "longest_request", "split_capacity"]

SHARE_SPLIT_HELP = (
    "size the tiers as a share F (0 < F <= 1) of the workload's unique blocks: total = round(F * unique); "
    "GPU = max(longest request, 10%% of total); CPU = 25%% of total (at most the rest less one block); "
    "disk = the rest (enabled). Overrides gpu.num_blocks and the CPU and disk capacities"
)


@dataclass(frozen=True)
class TierSplit:
    """Blocks per tier for one capacity share; ``total`` is what the replay's total_blocks will be."""

    share: float
    unique: int
    longest: int
    gpu: int
    cpu: int
    disk: int

    @property
    def total(self) -> int:
        return self.gpu + self.cpu + self.disk

    def as_dict(self) -> dict:
        return {**asdict(self), "total": self.total}


def longest_request(requests: Sequence[Request]) -> int:
    """Blocks of the longest request (0 for none)."""
    return max((len(r.hash_ids) for r in requests), default=0)


def _percent(total: int, pct: int) -> int:
    return (total * pct + 50) // 100  # pct % of total, half up, no float error


def split_capacity(unique: int, longest: int, share: float) -> TierSplit:
    """Blocks per tier for ``share`` of ``unique`` blocks (see the module docstring)."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not math.isfinite(share):
        raise ConfigError(f"--capacity-share: must be a number with 0 < share <= 1, got {share!r}")
    if not 0 < share <= 1:
        raise ConfigError(f"--capacity-share: must be within (0, 1], got {share!r}")
    for name, value in (("unique blocks", unique), ("longest request", longest)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"--capacity-share: {name} must be a non-negative integer, got {value!r}")
    total = round(share * unique)
    gpu = max(longest, _percent(total, 10))
    rest = total - gpu
    if rest < 2:
        need = longest + 2  # the smallest total that leaves a CPU and a disk block beside the GPU
        hint = f"use a share of at least {need / unique:.3g}" if need <= unique else "no share is enough"
        raise ConfigError(
            f"--capacity-share {share:g}: {total} blocks ({share:g} of {unique} unique blocks) leave {max(rest, 0)} "
            f"after the GPU's {gpu} (it must hold the longest request, {longest} blocks); the CPU and disk tiers "
            f"need at least 1 block each: {hint}"
        )
    cpu = min(_percent(total, 25), rest - 1)
    return TierSplit(share, unique, longest, gpu, max(cpu, 1), rest - max(cpu, 1))
