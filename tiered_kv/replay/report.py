"""The replay report: one dict (the ``--json`` output) and its rich rendering.

Hit rates are block-weighted under prefix semantics, as in the simulators: a
block counts as a hit only inside the leading run a request found (GPU first,
then CPU/disk), and only when its bytes verified. GB/s per direction is bytes
over the summed wall time of the copies (concurrent copies overlap, so it is a
per-copy rate, not the machine's aggregate); ``run_gb_per_s`` is bytes over the
whole replay's wall time.

Beside the replay, at its total_blocks (GPU + CPU + disk slots), stand the flat
single-tier yardsticks: LRU as is and with partial last blocks dropped, every
registered policy with them dropped, Belady both ways, and the unbounded cache.

With the remote tier on, ``remote`` hits are blocks served from Redis. In a fleet
(``--instances N``) those are the cross-instance hits: another instance stored them, or
this one did and has since evicted them. ``fleet`` then lists every instance; the totals
are the fleet's, and the yardsticks stand at the fleet's total blocks (Redis not counted).
"""

from __future__ import annotations

from typing import Any

from ..metrics import DIRECTIONS, runs_summary
from ..sizes import format_size
from .run import ReplayResult
from .simulate import SimResult
from .sizing import TierSplit


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _latency(values: list[float]) -> dict[str, Any]:
    p50, p99 = _pct(values, 0.50), _pct(values, 0.99)
    return {
        "count": len(values),
        "p50_ms": None if p50 is None else p50 * 1e3,
        "p99_ms": None if p99 is None else p99 * 1e3,
    }


def build_report(
    result: ReplayResult,
    sims: dict[str, SimResult],
    *,
    workload: str,
    unique: int | None = None,
    split: TierSplit | None = None,
) -> dict[str, Any]:
    s, m = result.stats, result.metrics
    refs = s.block_refs
    # pending: blocks in flight (being stored or promoted) at lookup, loaded once they landed
    hits = {"gpu": s.hits_gpu, "cpu": s.hits_cpu, "disk": s.hits_disk, "remote": s.hits_remote,
            "pending": s.hits_pending}
    total_hits = sum(hits.values())
    transfers = {}
    for d in DIRECTIONS:
        nbytes = m.get(f"tiered_kv_bytes_total{{{d}}}", 0.0)
        secs = m.get(f"tiered_kv_transfer_seconds_total{{{d}}}", 0.0)
        transfers[d] = {
            "blocks": int(m.get(f"tiered_kv_blocks_moved_total{{{d}}}", 0.0)),
            "bytes": int(nbytes),
            "seconds": secs,
            "gb_per_s": nbytes / secs / 1e9 if secs > 0 else None,
            "run_gb_per_s": nbytes / result.wall_s / 1e9 if result.wall_s > 0 else None,
        }
    return {
        "workload": workload,
        "device": result.device,
        "requests": s.requests,
        "block_refs": refs,
        "unique_blocks": unique,
        "policy": result.policy,
        "concurrency": result.concurrency,
        "hints": result.hints,
        "drop_partial": result.drop_partial,
        "block_tokens": result.block_tokens,
        "capacity_share": None if split is None else split.as_dict(),
        "hit_rate": {
            "total": total_hits / refs if refs else 0.0,
            **{t: n / refs if refs else 0.0 for t, n in hits.items()},
        },
        # The flat cache of the same policy and total size: what one policy over the stack should reach.
        "yardstick": _yardstick(result.policy, result.drop_partial, sims, total_hits / refs if refs else 0.0),
        "hit_blocks": {"total": total_hits, **hits},
        "tokens_not_recomputed": total_hits * result.block_tokens,
        "computed_blocks": s.computed,
        "truncated_blocks": s.truncated,
        "transfers": transfers,
        "latency": {"load": _latency(s.load_latency), "store": _latency(s.store_latency)},
        "store": {
            "stored": s.stored,
            "deduped": s.deduped,
            "in_flight": s.store_in_flight,
            "skipped": s.store_skipped,
            "demoted": s.demoted,
            "partial_dropped": s.partial_dropped,
            "released": s.released,
        },
        # Runs of consecutive CPU slots per store plan (one copy per run; copy-path-design.md 2.1.5).
        "slot_runs": runs_summary(result.slot_runs, result.slot_run_blocks),
        "spills": int(m.get("tiered_kv_spills_total", 0.0)),
        "evictions": {t: int(m.get(f"tiered_kv_evictions_total{{{t}}}", 0.0)) for t in ("cpu", "disk")},
        "degraded_events": int(
            sum(m.get(f"tiered_kv_degraded_events_total{{{t}}}", 0.0) for t in ("cpu", "disk", "remote"))
        ),
        "store_skipped": int(m.get("tiered_kv_store_skipped_total", 0.0)),
        # Blocks the cache itself caught (disk checksum) and served as misses.
        "cache_rejected_blocks": int(
            sum(m.get(f"tiered_kv_corrupt_blocks_total{{{t}}}", 0.0) for t in ("cpu", "disk"))
            + m.get("tiered_kv_remote_blocks_total{get,corrupt}", 0.0)
        ),
        "remote": _remote(result) if result.remote else None,
        "verified_blocks": s.verified,
        "corrupt_blocks": s.corrupt,
        "wall_s": result.wall_s,
        "capacity": {
            "bytes_per_block": result.bytes_per_block,
            "gpu_blocks": result.gpu_blocks,
            "cpu_slots": result.cpu_slots,
            "disk_slots": result.disk_slots,
            "total_blocks": result.total_blocks,
        },
        "simulated": {
            name: {"capacity_blocks": r.capacity_blocks, "hit_rate": r.hit_rate} for name, r in sims.items()
        },
    }


def _yardstick(policy: str, drop_partial: bool, sims: dict, hit_rate: float) -> dict[str, Any] | None:
    """The flat simulation of the replay's own policy (``{policy}_drop_partial`` when partial blocks are dropped)."""
    name = f"{str(policy).lower()}_drop_partial" if drop_partial else str(policy).lower()
    sim = sims.get(name)
    if sim is None:
        return None
    return {"name": name, "hit_rate": sim.hit_rate, "gap_points": (hit_rate - sim.hit_rate) * 100}


def _remote(result: ReplayResult) -> dict[str, Any]:
    """The remote tier's side: hits served from Redis (cross-instance hits in a fleet) and its own counts."""
    m, refs = result.metrics, result.stats.block_refs

    def blocks(op: str, res: str) -> int:
        return int(m.get(f"tiered_kv_remote_blocks_total{{{op},{res}}}", 0.0))

    return {
        "cross_instance_hits": result.stats.hits_remote,
        "hit_rate": result.stats.hits_remote / refs if refs else 0.0,
        "stored": blocks("put", "stored"),
        "loaded": blocks("get", "hit"),
        "gone": blocks("get", "miss"),  # believed present, missing at load: recomputed
        "rejected": blocks("get", "corrupt"),  # failed verification: a miss, never data
        "probed_present": blocks("exists", "present"),
        "probed_absent": blocks("exists", "absent"),
        "failed": sum(blocks(op, "failed") for op in ("put", "get", "exists")),
        "degraded_events": int(m.get("tiered_kv_degraded_events_total{remote}", 0.0)),
    }


def add_fleet(report: dict[str, Any], instances: list[ReplayResult], route: str) -> dict[str, Any]:
    """``report["fleet"]``: the route and every instance's hits (the report's totals are the fleet's)."""
    rows = []
    for i, r in enumerate(instances):
        s, refs = r.stats, r.stats.block_refs
        hits = {"gpu": s.hits_gpu, "cpu": s.hits_cpu, "disk": s.hits_disk, "remote": s.hits_remote,
                "pending": s.hits_pending}  # fmt: skip
        total = sum(hits.values())
        rows.append({
            "instance": i,
            "requests": s.requests,
            "block_refs": refs,
            "hit_rate": {"total": total / refs if refs else 0.0, **{t: n / refs if refs else 0.0 for t, n in hits.items()}},
            "hit_blocks": {"total": total, **hits},
            "capacity": {"gpu_blocks": r.gpu_blocks, "cpu_slots": r.cpu_slots, "disk_slots": r.disk_slots},
            "verified_blocks": s.verified,
            "corrupt_blocks": s.corrupt,
        })  # fmt: skip
    report["fleet"] = {"instances": len(instances), "route": route, "per_instance": rows}
    return report


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} ms"


def print_report(report: dict[str, Any], console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    r = report
    hr, hb, cap = r["hit_rate"], r["hit_blocks"], r["capacity"]
    t = Table(title=f"tiered_kv replay: {r['workload']}", show_header=False)
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    t.add_row("requests / block refs", f"{r['requests']:,} / {r['block_refs']:,}")
    t.add_row(
        "capacity (blocks)",
        f"gpu {cap['gpu_blocks']:,} + cpu {cap['cpu_slots']:,} + disk {cap['disk_slots']:,} = {cap['total_blocks']:,}"
        f" x {format_size(cap['bytes_per_block'])}",
    )
    t.add_row(
        "policy / concurrency / hints / drop partial",
        f"{r['policy']} / {r['concurrency']} / {'on' if r['hints'] else 'off'} / {'on' if r['drop_partial'] else 'off'}",
    )
    if r["capacity_share"]:
        t.add_row("capacity share", f"{r['capacity_share']['share']:g} of {r['unique_blocks']:,} unique blocks")
    t.add_row("hit rate (block-weighted, prefix)", f"{hr['total']:.1%}")
    for tier in ("gpu", "cpu", "disk", "remote", "pending"):
        if tier != "remote" or r["remote"]:
            t.add_row(f"  {tier}", f"{hr[tier]:.1%}  ({hb[tier]:,} blocks)")
    if r["remote"]:
        rm = r["remote"]
        t.add_row("remote: cross-instance hits", f"{rm['cross_instance_hits']:,} blocks served from Redis")
        t.add_row(
            "remote: stored / loaded / gone / rejected",
            f"{rm['stored']:,} / {rm['loaded']:,} / {rm['gone']:,} / {rm['rejected']:,}",
        )
    if r.get("fleet"):
        t.add_row("instances / route", f"{r['fleet']['instances']} / {r['fleet']['route']}")
    st = r["store"]
    t.add_row(
        "stored (demoted) / partial dropped / released",
        f"{st['stored']:,} ({st['demoted']:,}) / {st['partial_dropped']:,} / {st['released']:,}",
    )
    t.add_row("tokens not recomputed", f"{r['tokens_not_recomputed']:,}")
    for d, x in r["transfers"].items():
        rate = "-" if x["gb_per_s"] is None else f"{x['gb_per_s']:.3g} GB/s per copy, {x['run_gb_per_s']:.3g} over the run"
        t.add_row(f"{d}", f"{format_size(x['bytes'])} ({x['blocks']:,} blocks), {rate}")
    for op in ("load", "store"):
        lat = r["latency"][op]
        t.add_row(
            f"{op} latency p50 / p99", f"{_ms(lat['p50_ms'])} / {_ms(lat['p99_ms'])}  (n={lat['count']:,})"
        )
    sr = r["slot_runs"]
    if sr["calls"]:
        t.add_row(
            "CPU slot runs per store plan: mean / p90 / max",
            f"{sr['mean']:.2f} / {sr['p90']} / {sr['max']}  ({sr['calls']:,} plans of {sr['blocks_mean']:.1f} blocks)",
        )
    t.add_row(
        "spills / evictions cpu / disk",
        f"{r['spills']:,} / {r['evictions']['cpu']:,} / {r['evictions']['disk']:,}",
    )
    t.add_row("degraded events / store skipped", f"{r['degraded_events']} / {r['store_skipped']:,}")
    t.add_row("rejected by cache checks (misses)", f"{r['cache_rejected_blocks']:,}")
    t.add_row("verified / corrupt blocks", f"{r['verified_blocks']:,} / {r['corrupt_blocks']:,}")
    t.add_row("wall time", f"{r['wall_s']:.1f} s")
    console.print(t)

    if r.get("fleet") and r["fleet"]["instances"] > 1:
        console.print(fleet_table(r))
    console.print(yardstick_table(r))
    if r["corrupt_blocks"]:
        console.print(f"[bold red]{r['corrupt_blocks']} corrupt block(s) were served[/]")


def fleet_table(r: dict[str, Any]):
    """Hit rates per instance and for the fleet."""
    from rich.table import Table

    t = Table(title=f"per instance ({r['fleet']['route']} routing; remote = served from Redis)")
    for col in ("instance", "requests", "hit rate", "gpu", "cpu", "disk", "remote", "pending", "corrupt"):
        t.add_column(col, justify="left" if col == "instance" else "right")

    def row(name: str, requests: int, hr: dict[str, float], corrupt: int) -> None:
        tiers = (f"{hr[k]:.1%}" for k in ("gpu", "cpu", "disk", "remote", "pending"))
        t.add_row(name, f"{requests:,}", f"{hr['total']:.1%}", *tiers, f"{corrupt:,}")

    for x in r["fleet"]["per_instance"]:
        row(str(x["instance"]), x["requests"], x["hit_rate"], x["corrupt_blocks"])
    row("fleet", r["requests"], r["hit_rate"], r["corrupt_blocks"])
    return t


YARDSTICK_NAMES = {"unbounded": "unbounded (no eviction)"}


def yardstick_table(r: dict[str, Any]):
    """The replay beside the flat simulators at the same total blocks."""
    from rich.table import Table

    hr, cap = r["hit_rate"], r["capacity"]
    t = Table(title="same requests, same total blocks: this replay and flat single-tier caches (simulated)")
    t.add_column("cache")
    t.add_column("blocks", justify="right")
    t.add_column("hit rate", justify="right")
    tiers = ("gpu", "cpu", "disk", "remote", "pending") if r["remote"] else ("gpu", "cpu", "disk", "pending")
    t.add_column(" / ".join(tiers), justify="right")
    t.add_row(
        f"tiered_kv replay ({r['policy']})",
        f"{cap['total_blocks']:,}",
        f"{hr['total']:.1%}",
        " / ".join(f"{hr[k]:.1%}" for k in tiers),
    )
    y = r.get("yardstick")
    for name, x in r["simulated"].items():
        label = YARDSTICK_NAMES.get(name, f"flat {name.replace('_drop_partial', ' + drop partial')}")
        if y is not None and name == y["name"]:
            label += f"  <- this policy's yardstick ({y['gap_points']:+.2f} pts)"
        t.add_row(label, f"{x['capacity_blocks']:,}", f"{x['hit_rate']:.1%}", "")
    return t
