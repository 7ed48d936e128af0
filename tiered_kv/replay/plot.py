"""Capacity sweep: real replays at a few CPU+disk capacities, drawn against LRU and Belady.

Each point is a full replay through a real cache (fresh disk directory), its hit
rate split by the tier that served it, next to the single-tier simulators at the
same total capacity (GPU + CPU + disk blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ..config import Config, load_config
from .run import run_replay, simulate
from .trace import Request

# CPU+disk capacity multipliers. The GPU stays fixed (it must hold a whole request); the
# small scales matter most, because hit rates stop rising once the working set fits.
SCALES = (0.02, 0.05, 0.1, 0.25, 1.0)


@dataclass(frozen=True)
class SweepPoint:
    scale: float
    total_blocks: int
    gpu: float
    cpu: float
    disk: float
    lru: float
    belady: float
    unbounded: float
    corrupt: int

    @property
    def tiered(self) -> float:
        return self.gpu + self.cpu + self.disk

    def as_dict(self) -> dict:
        return {**asdict(self), "tiered": self.tiered}


def scaled(cfg: Config, scale: float, bytes_per_block: int) -> Config:
    """``cfg`` with CPU and disk capacities times ``scale`` (at least one block each)."""
    data = cfg.model_dump()
    for tier in ("cpu", "disk"):
        cap = data["tiers"][tier]["capacity"]
        data["tiers"][tier]["capacity"] = max(bytes_per_block, int(cap * scale))
    return load_config(data)


def sweep(
    cfg: Config,
    requests: Sequence[Request],
    *,
    scales: Sequence[float] = SCALES,
    max_requests: int = 1500,
    keep_disk: bool = False,
) -> list[SweepPoint]:
    """One replay per scale, on the first ``max_requests`` requests (keeps ``--plot`` quick)."""
    reqs = list(requests[:max_requests])
    points = []
    for scale in scales:
        res = run_replay(scaled(cfg, scale, cfg.bytes_per_block), reqs, keep_disk=keep_disk)
        s = res.stats
        refs = max(1, s.block_refs)
        sims = simulate(reqs, res.total_blocks)
        points.append(
            SweepPoint(
                scale,
                res.total_blocks,
                s.hits_gpu / refs,
                s.hits_cpu / refs,
                s.hits_disk / refs,
                sims["lru"].hit_rate,
                sims["belady"].hit_rate,
                sims["unbounded"].hit_rate,
                s.corrupt,
            )
        )
    return points


def plot_sweep(points: Sequence[SweepPoint], path: str, *, title: str = "") -> None:
    """Stacked bars (tiered_kv by serving tier) with LRU / Belady lines, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: never open a window
    import matplotlib.pyplot as plt

    labels = [f"{p.total_blocks:,}\n(x{p.scale:g})" for p in points]
    pos = list(range(len(points)))
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    bottom = [0.0] * len(points)
    for tier, color in (("gpu", "#4c72b0"), ("cpu", "#55a868"), ("disk", "#c44e52")):
        vals = [getattr(p, tier) * 100 for p in points]
        ax.bar(pos, vals, 0.6, bottom=bottom, color=color, label=f"tiered_kv: {tier.upper()} hits")
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.plot(pos, [p.lru * 100 for p in points], "o-", color="black", label="LRU (single tier, same capacity)")
    ax.plot(pos, [p.belady * 100 for p in points], "s--", color="#8172b2", label="Belady (offline optimum)")
    if points:
        ax.axhline(points[0].unbounded * 100, color="grey", linestyle=":", label="unbounded")
    for i, p in enumerate(points):
        ax.annotate(f"{p.tiered:.1%}", (i, bottom[i]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(pos, labels)
    ax.set_xlabel("total capacity, GPU + CPU + disk (blocks; CPU+disk scale)")
    ax.set_ylabel("block hit rate (%)")
    ax.set_ylim(0, 100)
    ax.set_title(f"hit rate vs capacity{': ' + title if title else ''}", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
