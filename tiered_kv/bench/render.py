"""`tiered-kv bench` as rich tables: ratios first, each with its spread, warnings where the bench is suspect."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text


def _size(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n >> 10}K"


def _spread(s: dict, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(s['median'])} [{fmt.format(s['q1'])}-{fmt.format(s['q3'])}]"


def _range(s: dict, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(s['lo'])}-{fmt.format(s['hi'])}"


def _verdict(row: dict) -> Text:
    if "meets_target" not in row:
        return Text("")
    goal = row.get("target_min", row.get("target_max"))
    sign = ">=" if "target_min" in row else "<="
    return Text(f"{sign}{goal:g} " + ("met" if row["meets_target"] else "missed"),
                style="green" if row["meets_target"] else "red")  # fmt: skip


# Short names for the table; the JSON keeps the full ones.
_SHORT = {"torch.index_select(out=)": "index_select", "numpy.take(out=)": "np.take", "numpy gather": "np gather",
          "numpy scatter": "np scatter", "numpy contiguous + scatter": "np contig+scatter",
          "os.pwritev, 1 per batch": "pwritev", "os.preadv, 1 per batch": "preadv"}  # fmt: skip


def _copy_table(title: str, rows: list[dict], extra: str | None = None) -> Table:
    """One row per case: medians of each side, the ratio with its quartiles (min-max is in --json)."""
    rounds = sorted({r["rounds"] for r in rows})
    caption = f"{'/'.join(map(str, rounds))} rounds; case = op, block size x regions per block"
    t = Table("case", "raw GB/s", "ours GB/s", *([extra] if extra else []), "ratio [q1-q3]", "target", "raw ref",
              title=title, caption=caption)  # fmt: skip
    for r in rows:
        cells = [f"{r['op']} {_size(r['block_bytes'])} x{r['regions']}", f"{r['raw_gbps']['median']:.2f}",
                 f"{r['ours_gbps']['median']:.2f}"]  # fmt: skip
        if extra:
            cells.append(f"{r['pinned_dma_gbps']:.2f}")
        ratio = Text(_spread(r["ratio"]), style="bold red" if "warning" in r else "")
        t.add_row(*cells, ratio, _verdict(r), _SHORT.get(r["raw_method"], r["raw_method"]))
    return t


def _inflight_table(title: str, rows: list[dict], gpu: bool = False) -> Table:
    """Calls in flight: ratio to raw per round (N = 1: latency; more: throughput), host us per call and its split."""
    t = Table("case", "in flight", "ours GB/s", "ratio [q1-q3]", *(["of DMA", "of link"] if gpu else []),
              "host us/call", "engine", "cache", "slot runs", "target", title=title)  # fmt: skip
    for r in rows:
        case = f"{r['op']} {_size(r['block_bytes'])} x{r['regions']}"
        if r["op"] == "both":
            t.add_row(case, "1+1", "", Text(_spread(r["ratio"]) + " of one way"), *(["", ""] if gpu else []),
                      f"overlap {r['overlap']['median']:.2f}", "", "", "", _verdict(r))  # fmt: skip
            continue
        h = r["host_us"]
        t.add_row(case, str(r["inflight"]), f"{r['ours_gbps']['median']:.2f}",
                  Text(_spread(r["ratio"]), style="bold red" if "warning" in r else ""),
                  *([f"{r['of_dma']:.2f}", f"{r['of_link']:.2f}"] if gpu else []),
                  f"{h['whole']['median']:.0f}", f"{h['engine']['median']:.0f}", f"{h['cache']['median']:.0f}",
                  f"{r['slot_runs']['median']:g}", _verdict(r))  # fmt: skip
    return t


def _call_cost(console: Console, rows: list[dict]) -> None:
    t = Table("case", "ours us", "engine", "cache", "floor", "dict loop", "time ratio [q1-q3]", "target",
              title="the cache's own host time per 64-block call (engine counted, not run; disk: write_through)")  # fmt: skip
    lines = []
    for r in rows:
        case = f"{r['op']} {r['tier']}" + (f" {r['policy']}" if r["tier"] != "cpu" else "")
        t.add_row(case, f"{r['ours_us']['median']:.0f}", f"{r['engine_us']['median']:.0f}",
                  f"{r['cache_us']['median']:.0f}", f"{r['floor_us']:.0f}" if "floor_us" in r else "",
                  f"{r['raw_us']['median']:.1f}", _spread(r["time_ratio"], "{:.1f}"),
                  _verdict(r))  # fmt: skip
        parts = r.get("profile_us", {}).get("parts", {})
        if parts:
            lines.append(f"  {case}: " + ", ".join(f"{k} {v:.0f}" for k, v in parts.items() if v >= 0.5))
    console.print(t)
    if lines:
        console.print("parts of a call, us (cProfile's shares of the figure above):")
        for line in lines:
            console.print(line)


def _warnings(console: Console, rows: list[dict], section: str) -> None:
    for r in rows:
        if "warning" in r:
            where = f"{section} {r['op']} {_size(r['block_bytes'])} x{r['regions']}"
            console.print(Text(f"warning: {where}: {r['warning']}", style="bold red"))


def render(result: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    meta = result["meta"]
    console.print(Text.assemble(("tiered-kv bench", "bold"),
                                f": ratio = ours' speed / raw's in each round (1.0 = parity), median [quartiles] over "
                                f"the rounds; calls of {meta['batch_blocks']} blocks; torch threads "
                                f"{meta['torch_threads']}, {meta['cpus']} CPUs; {meta['seconds']} s"))  # fmt: skip
    if "cache" in result:
        console.print(_copy_table("cache: store/load through TieredKVCache (host engine) vs the fastest raw copy",
                                  result["cache"]))  # fmt: skip
        _warnings(console, result["cache"], "cache")
    if "disk" in result:
        console.print(_copy_table("disk: spill/promote through the cache vs raw pwritev/preadv", result["disk"]))
        _warnings(console, result["disk"], "disk")
    if "disk_store" in result:
        store = result["disk_store"]
        console.print(_copy_table("disk: the DiskStore alone vs raw pwritev/preadv (x1: one part per block)",
                                  store["rows"]))  # fmt: skip
        _warnings(console, store["rows"], "disk store")
        runs = ", ".join(f"{r['blocks']:,} blocks / {r['journal_records']:,} records: {r['blocks_per_s']:,}/s"
                         for r in store["recovery"])  # fmt: skip
        console.print(f"restart recovery (DiskStore.open): {runs}")
    if "lookup" in result:
        r = result["lookup"]
        console.print(Text.assemble(
            f"lookup of a {r['prefix']:,}-block prefix: ours {_spread(r['ours_us'], '{:.1f}')} us, dict loop "
            f"{_spread(r['raw_us'], '{:.1f}')} us; time ratio {_spread(r['time_ratio'])} "
            f"(min-max {_range(r['time_ratio'])}, {r['rounds']} rounds) ", _verdict(r)))  # fmt: skip
    if "manager" in result:
        r = result["manager"]
        console.print(Text.assemble(
            f"prepare_store + complete_store of {r['batch']} new keys: ours {_spread(r['ours_us'], '{:.1f}')} us, "
            f"dict-insert loop {_spread(r['raw_us'], '{:.1f}')} us; time ratio {_spread(r['time_ratio'])} "
            f"(min-max {_range(r['time_ratio'])}, {r['rounds']} rounds) ", _verdict(r)))  # fmt: skip
    for r in result.get("manager_hierarchy", []):
        console.print(Text.assemble(
            f"  the same over CPU + disk ({r['policy']}, {r['slots']:,} + {r['disk_slots']:,} slots, each store "
            f"spilling {r['batch']}): ours {_spread(r['ours_us'], '{:.1f}')} us; time ratio "
            f"{_spread(r['time_ratio'])} (no target; hold it per call)"))  # fmt: skip
    if "memory" in result:
        r = result["memory"]
        console.print(Text.assemble(
            f"memory at {r['resident_blocks']:,} resident blocks ({r['policy']}): {r['bytes_per_block']:.1f} B/block "
            f"(index arrays {r['index_arrays_bytes_per_block']:.1f}, other arrays {r['other_numpy_bytes_per_block']:.1f}, "
            f"Python objects {r['python_objects_bytes_per_block']:.2f}; events not yet taken would add "
            f"{r['undrained_events_bytes_per_block']:.1f}) ", _verdict(r)))  # fmt: skip
    if "host" in result:
        r = result["host"]
        for row in r["rows"]:
            us = row["host_us"]
            console.print(f"host time per {row['blocks']}-block call at {row['regions']} regions: table "
                          f"{us['table']:.0f} us (in place {us['table_direct']:.0f}), per-group {us['groups']:.0f} us "
                          f"({row['table_launches_per_call']:.0f} vs {row['group_launches_per_call']} launches a chunk)")
        console.print(Text.assemble(f"host time, table / per-group at {r['rows'][-1]['regions']} regions: "
                                    f"{r['time_ratio_at_most_regions']:.2f} ", _verdict(r)))  # fmt: skip
    if "inflight" in result:
        console.print(_inflight_table("calls in flight through TieredKVCache vs the raw copies of the same batches "
                                      "(host engine)", result["inflight"]))  # fmt: skip
        _warnings(console, [r for r in result["inflight"] if r["op"] != "both"], "inflight")
    if "call_cost" in result:
        _call_cost(console, result["call_cost"])
    gpu = result.get("gpu")
    if gpu is not None:
        if "skipped" in gpu:
            console.print(f"gpu: skipped, {gpu['skipped']}")
        else:
            console.print(_copy_table(f"gpu ({gpu['device']}): store (D2H) / load (H2D) through the CUDA engine "
                                      f"vs the fastest raw pinned copy", gpu["rows"], extra="1 DMA GB/s"))  # fmt: skip
            _warnings(console, gpu["rows"], "gpu")
            if "inflight" in gpu:
                console.print(_inflight_table(f"gpu ({gpu['device']}): calls in flight through the CUDA engine",
                                              gpu["inflight"], gpu=True))  # fmt: skip
