"""``tiered-kv replay``: resolve the config, replay, print the report (and the capacity sweep plot).

Split from run.py so that the replay itself knows nothing of its report and plot,
which build on it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from .fleet import check_fleet_options, run_fleet
from .plot import plot_sweep, sweep
from .report import add_fleet, build_report, print_report
from .run import (
    BLOCK_TOKENS,
    load_requests,
    resolve_config,
    run_replay,
    simulate,
    with_capacity_share,
)
from .simulate import unique_blocks

T = TypeVar("T")


def run_replay_cli(args: argparse.Namespace) -> int:
    """``tiered-kv replay``: 0 when every loaded block verified, 1 if any was corrupt."""
    from rich.console import Console

    cfg = resolve_config(
        args.config,
        block_bytes=args.block_bytes,
        concurrency=args.concurrency,
        speed=args.speed,
        max_requests=args.max_requests,
        policy=getattr(args, "policy", None),
        hints=getattr(args, "hints", None),
        drop_partial=False if getattr(args, "keep_partial", False) else None,
        instances=getattr(args, "instances", None),
        route=getattr(args, "route", None),
    )
    keep_disk = bool(getattr(args, "keep_disk", False))
    check_fleet_options(cfg, metrics_port=args.metrics_port, plot=args.plot, keep_disk=keep_disk)
    requests = load_requests(cfg, args.trace)
    split = None
    share = getattr(args, "capacity_share", None)
    if share is not None:
        cfg, split = with_capacity_share(cfg, requests, share)
    console = Console()
    show_progress = not (args.json or args.no_progress) and console.is_terminal
    # --instances N (1 included) runs over the shared remote tier; without one, a single replay.
    runner = run_fleet if cfg.tiers.remote.enabled else run_replay
    out = _with_progress(
        console if show_progress else None,
        len(requests),
        lambda on_done: runner(
            cfg, requests, keep_disk=keep_disk, on_done=on_done, metrics_port=args.metrics_port,
            block_tokens=BLOCK_TOKENS,
        ),
    )
    fleet = out if cfg.tiers.remote.enabled else None
    result = fleet.total if fleet is not None else out
    sims = simulate(requests, result.total_blocks, block_tokens=result.block_tokens)
    workload = str(args.trace) if args.trace else f"built-in chat workload (seed {cfg.replay.seed})"
    report = build_report(result, sims, workload=workload, unique=unique_blocks(requests), split=split)
    if fleet is not None:
        add_fleet(report, fleet.instances, fleet.route)
    if args.plot:
        err = Console(stderr=True)
        done = sweep(cfg, requests, block_tokens=result.block_tokens,
                     progress=err.log if show_progress else None)  # fmt: skip
        plot_sweep(done, args.plot, title=workload)
        report["plot"] = {"path": str(args.plot), **done.as_dict()}
    if args.json:
        import json

        print(json.dumps(report, indent=2))
    else:
        print_report(report, console)
    return 1 if result.stats.corrupt else 0


def _with_progress(console, total: int, body: Callable[[Callable[[], None] | None], T]) -> T:
    if console is None:
        return body(None)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("replay"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("replay", total=total)
        return body(lambda: bar.advance(task))
