"""Side-by-side statistics: raw and ours interleaved, medians with their spread, and a broken-bench check.

Shared machines drift by 2x within a minute, so one figure is never trusted
alone: raw and ours run alternately, every round gives one ratio from two
samples taken moments apart, and the report is the median of those ratios
with the quartiles and extremes beside it. Where several raw implementations
could be the fastest, every one runs in every round and the reference is the
one with the best median over the whole run.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

from ..errors import TieredKVError

# A raw reference more than this much slower than ours means the bench copies
# something else, or copies it badly: flag it instead of reporting the ratio.
RAW_SLOWER_LIMIT = 1.2
MIN_ROUNDS = 9


@dataclass(frozen=True)
class Spread:
    """Median of a sample with its quartiles (q1, q3) and extremes (lo, hi)."""

    median: float
    q1: float
    q3: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        xs = sorted(float(v) for v in values)
        if not xs:
            raise TieredKVError("bench: Spread.of needs at least one value")
        if len(xs) == 1:
            return cls(xs[0], xs[0], xs[0], xs[0], xs[0], 1)
        q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
        return cls(med, q1, q3, xs[0], xs[-1], len(xs))

    def as_dict(self, digits: int = 4) -> dict[str, float | int]:
        return {k: (round(v, digits) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def compare(raw_s: Sequence[float], ours_s: Sequence[float], nbytes: int | None = None, *,
            raw_is_fastest: bool = True) -> dict:
    """Summarize paired samples (seconds per sample, raw[i] and ours[i] from the same round).

    ``ratio`` is ours' speed relative to raw per round (raw_s / ours_s: 1.0 is parity,
    higher is faster). With ``nbytes`` (bytes per sample) the GB/s of each side are
    given too. ``raw_is_fastest`` says the raw side is meant to be the fastest way to
    do the same work; a median ratio above RAW_SLOWER_LIMIT then adds a ``warning``.
    """
    if len(raw_s) != len(ours_s) or not raw_s:
        raise TieredKVError(f"bench: compare needs paired samples, got {len(raw_s)} raw and {len(ours_s)} ours")
    if min(raw_s) <= 0 or min(ours_s) <= 0:
        raise TieredKVError(f"bench: compare needs positive durations, got min raw {min(raw_s)}, min ours {min(ours_s)}")
    raw, ours = Spread.of(raw_s), Spread.of(ours_s)
    ratio = Spread.of([r / o for r, o in zip(raw_s, ours_s, strict=True)])
    out: dict = {"rounds": len(raw_s), "ratio": ratio.as_dict(), "raw_s": raw.as_dict(9), "ours_s": ours.as_dict(9)}
    if nbytes is not None:
        out["raw_gbps"] = Spread.of([nbytes / 1e9 / s for s in raw_s]).as_dict(3)
        out["ours_gbps"] = Spread.of([nbytes / 1e9 / s for s in ours_s]).as_dict(3)
    if raw_is_fastest and ratio.median > RAW_SLOWER_LIMIT:
        out["warning"] = (f"raw reference slower than ours (median ratio {ratio.median:.2f} > {RAW_SLOWER_LIMIT}): "
                          f"a broken bench, not a fast cache")
    return out


Sampler = Callable[[int], Awaitable[float]]


async def interleave(raws: dict[str, Sampler], ours: Sampler, rounds: int, *,
                     warmup: int = 1) -> tuple[dict[str, list[float]], list[float]]:  # fmt: skip
    """Run ours and every raw candidate once per round; each sampler returns the seconds of its sample i.

    Round i runs the sides one after another, the order rotated by one each round
    (ours first, then raw first, ...), so whatever the previous sample leaves behind
    (a warm cache, spinning OpenMP threads) falls on every side alike. ``warmup``
    rounds run first and are not kept.
    """
    order: list[str | None] = [None, *raws]  # None: ours
    raw_s: dict[str, list[float]] = {name: [] for name in raws}
    ours_s: list[float] = []
    for i in range(warmup + rounds):
        k = i % len(order)
        for name in order[k:] + order[:k]:
            t = await (ours(i) if name is None else raws[name](i))
            if i >= warmup:
                (ours_s if name is None else raw_s[name]).append(t)
    return raw_s, ours_s


def fastest(raw_s: dict[str, list[float]]) -> str:
    """The raw candidate with the lowest median time: the reference the ratios are taken against."""
    return min(raw_s, key=lambda name: statistics.median(raw_s[name]))


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic GC off for one timed sample (as ``timeit`` does): a full collection over a heap holding
    torch and numpy costs milliseconds, and landing in one part of a 200 us call it would be read as that
    part's cost. Each side of a comparison is sampled the same way."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()

