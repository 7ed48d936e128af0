"""``--plot``: hit rate against capacity share, one real replay per policy, beside the flat yardsticks.

At each share of the workload's unique blocks (SHARES) the tiers are sized by
sizing.split_capacity, and every registered eviction policy gets a full replay
through a real cache (a fresh disk directory each time, the configured
concurrency). Beside them, at the same total blocks, the flat single-tier
simulators: LRU, LRU + drop partial, Belady + drop partial (the JSON lists every
yardstick of ``run.simulate``). A share too small for the split (the GPU must hold
the longest request) is skipped and listed with its reason, not fatal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from ..config import Config
from ..errors import ConfigError
from ..policy import POLICIES
from .run import BLOCK_TOKENS, resolve_config, run_replay, simulate, with_capacity_share
from .simulate import unique_blocks
from .sizing import TierSplit, longest_request, split_capacity
from .trace import Request

SHARES = (0.01, 0.05, 0.10, 0.25)
# The yardsticks drawn beside the replays (key in run.simulate -> legend, line style).
DRAWN = (
    ("lru", "flat LRU", "o--", "black"),
    ("lru_drop_partial", "flat LRU + drop partial", "o:", "dimgrey"),
    ("belady_drop_partial", "Belady + drop partial (offline optimum)", "s--", "#8172b2"),
)


@dataclass(frozen=True)
class ReplayPoint:
    """One real replay: its hit rate split by the tier that served it (pending: loaded once in flight landed)."""

    gpu: float
    cpu: float
    disk: float
    pending: float
    corrupt: int

    @property
    def tiered(self) -> float:
        return self.gpu + self.cpu + self.disk + self.pending

    def as_dict(self) -> dict:
        return {**asdict(self), "tiered": self.tiered}


@dataclass(frozen=True)
class SweepPoint:
    """One capacity share: its tier split, a replay per policy, the flat yardsticks' hit rates."""

    split: TierSplit
    replays: dict[str, ReplayPoint] = field(default_factory=dict)
    simulated: dict[str, float] = field(default_factory=dict)

    @property
    def share(self) -> float:
        return self.split.share

    @property
    def total_blocks(self) -> int:
        return self.split.total

    def as_dict(self) -> dict:
        return {
            "share": self.share,
            "total_blocks": self.total_blocks,
            "split": self.split.as_dict(),
            "replays": {p: r.as_dict() for p, r in self.replays.items()},
            "simulated": dict(self.simulated),
        }


@dataclass
class Sweep:
    points: list[SweepPoint]
    skipped: list[dict]  # {"share", "reason"} for shares the split cannot size

    def as_dict(self) -> dict:
        return {"points": [p.as_dict() for p in self.points], "skipped": list(self.skipped)}


def sweep(
    cfg: Config,
    requests: Sequence[Request],
    *,
    shares: Sequence[float] = SHARES,
    policies: Sequence[str] = POLICIES,
    block_tokens: int = BLOCK_TOKENS,
    progress: Callable[[str], None] | None = None,
) -> Sweep:
    """A replay per (share, policy), and the yardsticks per share; see the module docstring."""
    reqs = list(requests)
    unique, longest = unique_blocks(reqs), longest_request(reqs)
    points: list[SweepPoint] = []
    skipped: list[dict] = []
    for share in shares:
        try:
            split_capacity(unique, longest, share)  # only the sizing may skip a share
        except ConfigError as exc:
            skipped.append({"share": share, "reason": str(exc)})
            continue
        replays: dict[str, ReplayPoint] = {}
        split = None
        for policy in policies:
            if progress is not None:
                progress(f"--plot: share {share:g}, policy {policy}")
            sized, split = with_capacity_share(resolve_config(cfg, policy=policy), reqs, share)
            res = run_replay(sized, reqs, block_tokens=block_tokens)  # a fresh disk directory each time
            s, refs = res.stats, max(1, res.stats.block_refs)
            replays[policy] = ReplayPoint(
                s.hits_gpu / refs, s.hits_cpu / refs, s.hits_disk / refs, s.hits_pending / refs, s.corrupt
            )
        if split is None:
            split = split_capacity(unique, longest, share)
        sims = simulate(reqs, split.total, block_tokens=block_tokens)
        points.append(SweepPoint(split, replays, {name: r.hit_rate for name, r in sims.items()}))
    return Sweep(points, skipped)


def plot_sweep(result: Sweep, path: str, *, title: str = "") -> None:
    """Hit rate (%) against capacity share: a line per policy's replay, the yardsticks dashed.

    The exact figures are in the JSON report (``plot.points``), not on the chart.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display: never open a window
    import matplotlib.pyplot as plt

    points = result.points
    pos = list(range(len(points)))
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    policies = list(points[0].replays) if points else []
    colors = ("#4c72b0", "#55a868", "#c44e52", "#dd8452", "#64b5cd")
    for i, policy in enumerate(policies):
        vals = [p.replays[policy].tiered * 100 for p in points]
        ax.plot(pos, vals, "o-", color=colors[i % len(colors)], linewidth=2, label=f"tiered_kv replay, {policy}")
    for key, label, style, color in DRAWN:
        if points and key in points[0].simulated:
            ax.plot(pos, [p.simulated[key] * 100 for p in points], style, color=color, label=label)
    if points and "unbounded" in points[0].simulated:
        ax.axhline(points[0].simulated["unbounded"] * 100, color="grey", linestyle=":", label="unbounded")
    ax.set_xticks(pos, [f"{p.share:.0%}\n{p.split.gpu:,}+{p.split.cpu:,}+{p.split.disk:,}" for p in points])
    ax.set_xlabel("capacity: share of unique blocks (GPU + CPU + disk blocks)")
    ax.set_ylabel("block hit rate (%)")
    top = max((p.simulated.get("unbounded", 1.0) for p in points), default=1.0)
    ax.set_ylim(0, min(100, top * 100 + 10))  # the figures sit close together: use the height
    note = "; skipped " + ", ".join(f"{s['share']:g}" for s in result.skipped) if result.skipped else ""
    ax.set_title(f"hit rate vs capacity{': ' + title if title else ''}{note}", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
