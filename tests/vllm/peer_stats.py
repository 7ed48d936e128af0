"""The peers bench's arithmetic, kept apart from vLLM so the normal suite tests it.

One engine run plays a script (``plan``): a warm-up, then per TTFT round a fresh ~960-token prompt
three times (recompute; after ``reset_prefix_cache()`` the offload hit; then vLLM's own GPU prefix
hit), then per no-hit round one batch of 32 distinct 200-token prompts. Every generate step carries
a tag, so ``samples`` reads a report by tag, never by position. ``summarise`` takes the medians
over every round of every pass and the no-hit throughput as a ratio to the no-connector engine's.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

ENGINES = ("none", "tiered_kv", "lmcache")
TITLES = {"none": "no connector", "tiered_kv": "tiered_kv", "lmcache": "LMCache (lmcache_driven)"}
TTFT_KINDS = ("recompute", "offload", "gpu")
STORE_SETTLE_S = 1.0  # between a prompt's first run and the reset: the connectors' stores land
# Counts, summed over the rounds rather than a median: hits whose greedy token differs from the
# recompute's, resets vLLM refused at first, LMCache's "degraded mode" entries in the engine's log.
# "unreset": offload hits not counted, vLLM having refused the reset before them (its blocks still held).
SUMMED = ("wrong_tokens", "reset_failures", "degraded", "unreset")


def plan(ttft_prompts: Sequence[list[int]], nohit_sets: Sequence[Sequence[list[int]]], warm: list[int],
         nohit_tokens: int = 32) -> tuple[list[dict], list[str]]:  # fmt: skip
    """The engine script and one tag per generate step, in order."""
    steps: list[dict] = [{"generate": [warm]}]
    tags = ["warm"]
    for p in ttft_prompts:
        steps += [{"generate": [p]}, {"sleep": STORE_SETTLE_S}, {"reset": True}, {"generate": [p]},
                  {"generate": [p]}, {"reset": True}]  # fmt: skip
        tags += list(TTFT_KINDS)
    for batch in nohit_sets:
        steps.append({"generate": [list(p) for p in batch], "max_tokens": nohit_tokens})
        tags.append("nohit")
    return steps, tags


def samples(report: dict, tags: Sequence[str]) -> dict[str, list[float]]:
    """Per tag: wall times in ms (TTFT kinds), the offload hit's cached tokens, no-hit output tokens/s,
    and per round how many of its two hits gave another first token than its recompute."""
    gens = [s for s in report["steps"] if "outputs" in s]
    if len(gens) != len(tags):
        raise ValueError(f"the engine reported {len(gens)} generate steps, the script has {len(tags)}")
    out: dict[str, list[float]] = {k: [] for k in (*TTFT_KINDS, "offload_cached", "nohit_tok_s", "wrong_tokens")}
    out["reset_failures"] = [report["steps"][0].get("reset_failures", 0)]
    out["unreset"] = []
    first: list[int] = []
    for tag, step in zip(tags, gens, strict=True):
        if tag == "offload" and step.get("after_failed_reset"):
            out["unreset"].append(1)
            continue
        if tag in TTFT_KINDS:
            out[tag].append(1000 * step["wall_s"])
            if tag == "recompute":
                first = step["outputs"][0]["tokens"]
            else:
                out["wrong_tokens"].append(int(step["outputs"][0]["tokens"] != first))
            if tag == "offload":
                out["offload_cached"].append(step["outputs"][0]["cached"])
        elif tag == "warm":  # the engine's first step: kernels built, and LMCache's first registration
            out["warm_ms"] = [1000 * step["wall_s"]]
        elif tag == "nohit":
            out["nohit_tok_s"].append(sum(len(o["tokens"]) for o in step["outputs"]) / step["wall_s"])
    return out


def merge(into: dict[str, list[float]], more: dict[str, list[float]]) -> None:
    for k, v in more.items():
        into.setdefault(k, []).extend(v)


def summarise(per_engine: dict[str, dict[str, list[float]]]) -> dict[str, dict[str, float | int | None]]:
    """Medians per engine; ``nohit_ratio`` is each engine's median tok/s over the no-connector one's."""
    med: dict[str, dict[str, float | int | None]] = {}
    for eng, s in per_engine.items():
        med[eng] = {k: (sum(v) if k in SUMMED else statistics.median(v) if v else None) for k, v in s.items()}
        med[eng]["rounds"] = min((len(s[k]) for k in (*TTFT_KINDS, "nohit_tok_s") if s.get(k)), default=0)
    base = med.get("none", {}).get("nohit_tok_s")
    for m in med.values():
        m["nohit_ratio"] = m["nohit_tok_s"] / base if base and m.get("nohit_tok_s") is not None else None
    return med


def order(pass_no: int, engines: Sequence[str] = ENGINES) -> list[str]:
    """The engines of one pass, rotated by the pass number: drift on a shared machine hits each alike."""
    k = pass_no % len(engines)
    return [*engines[k:], *engines[:k]]


def _fmt(v: float | int | None, f: Callable[[float], str]) -> str:
    return "-" if v is None else f(v)


def rows(summary: dict[str, dict], tp: int) -> list[list[str]]:
    """Table rows (TP, what, then one cell per engine of ENGINES); the no-connector engine has no offload hit."""
    def cells(f: Callable[[dict], str]) -> list[str]:
        return [f(summary[e]) if e in summary else "-" for e in ENGINES]

    def offload(m: dict) -> str:
        if m is summary.get("none"):
            return "-"
        return _fmt(m.get("offload"), lambda v: f"{v:.1f} ms") + _fmt(m.get("offload_cached"), lambda c: f" ({c:.0f})")

    t = f"TP={tp}"
    return [
        [t, "TTFT recompute", *cells(lambda m: _fmt(m.get("recompute"), lambda v: f"{v:.1f} ms"))],
        [t, "TTFT offload hit (cached tokens)", *cells(offload)],
        [t, "TTFT vLLM's own GPU prefix hit", *cells(lambda m: _fmt(m.get("gpu"), lambda v: f"{v:.1f} ms"))],
        [t, "no hits: output tok/s", *cells(lambda m: _fmt(m.get("nohit_tok_s"), lambda v: f"{v:.0f}"))],
        [t, "no hits: ratio to no connector", *cells(lambda m: _fmt(m.get("nohit_ratio"), lambda v: f"{v:.3f}"))],
        [t, "rounds (median of)", *cells(lambda m: str(m.get("rounds", 0)))],
        [t, "hits with another first token", *cells(lambda m: str(m.get("wrong_tokens") or 0))],
        [t, "offload hits dropped (reset refused 60 s)", *cells(lambda m: str(m.get("unreset") or 0))],
    ]  # fmt: skip


def table(all_rows: list[list[str]], title: str):
    from rich.table import Table

    tab = Table(title=title)
    for name in ("", "", *(TITLES[e] for e in ENGINES)):
        tab.add_column(name, justify="right" if name else "left")
    for r in all_rows:
        tab.add_row(*r)
    return tab
