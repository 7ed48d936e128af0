"""The ``tiered-kv`` command. Every subcommand takes ``--json``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from typing import Any

from .errors import TieredKVError

DEFAULT_CONFIG = "configs/default.yaml"


def _emit(args: argparse.Namespace, payload: Any, render) -> None:
    if args.json:
        print(json.dumps(payload, indent=2, default=str))
    else:
        render(payload)


def cmd_plan(args: argparse.Namespace) -> int:
    from .capacity import plan, render_plan
    from .config import load_config

    _emit(args, plan(load_config(args.config)), render_plan)
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    from .config import config_as_dict, load_config

    try:
        cfg = load_config(args.config)
    except TieredKVError as exc:
        if args.json:
            print(json.dumps({"ok": False, "error": str(exc)}))
        else:
            print(f"invalid config: {exc}", file=sys.stderr)
        return 2
    resolved = config_as_dict(cfg)
    if args.json:
        print(json.dumps({"ok": True, "config": resolved}, indent=2))
    else:
        import yaml

        print(f"# {args.config}: OK (bytes_per_block = {cfg.bytes_per_block})")
        print(yaml.safe_dump(resolved, sort_keys=False), end="")
    return 0


def cmd_disk(args: argparse.Namespace) -> int:
    from .tiers.disk_admin import list_namespaces, remove_namespaces

    try:
        infos = list_namespaces(args.path)
    except OSError as exc:
        print(f"error: cannot list {args.path}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if args.action == "ls":
        rows = [dataclasses.asdict(i) for i in infos]
        _emit(args, rows, _render_namespaces)
        return 0
    chosen = [i.dirname for i in infos if args.all or i.dirname in args.names]
    unknown = set(args.names) - {i.dirname for i in infos}
    if unknown:
        print(f"no such namespace under {args.path}: {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    removed = remove_namespaces(args.path, chosen)
    _emit(args, {"removed": removed}, lambda p: print("\n".join(f"removed {d}" for d in p["removed"]) or "nothing removed"))
    return 0


def _render_namespaces(rows: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    from .sizes import format_size

    table = Table("namespace", "model", "dtype", "layout", "bytes/block", "blocks", "size")
    for r in rows:
        table.add_row(
            r["dirname"], r["model_id"], r["dtype"], r["layout_digest"], str(r["bytes_per_block"]),
            str(r.get("blocks", "?")), format_size(int(r.get("size_bytes", 0))),
        )
    Console().print(table)


def cmd_replay(args: argparse.Namespace) -> int:
    from .replay.run import run_replay_cli

    return run_replay_cli(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench_cli

    return run_bench_cli(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiered-kv", description="Tiered KV-cache offload: plan, replay, bench.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, func, help_text: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)
        return p

    p = add("plan", cmd_plan, "bytes per block, slots and tokens per tier")
    p.add_argument("config", nargs="?", default=DEFAULT_CONFIG)
    p = add("check-config", cmd_check_config, "validate a config and print it resolved")
    p.add_argument("config")
    p = add("disk", cmd_disk, "list or remove disk-tier namespaces")
    p.add_argument("action", choices=["ls", "gc"])
    p.add_argument("path", help="the disk tier's directory (tiers.disk.path)")
    p.add_argument("names", nargs="*", help="gc: namespace directories to remove")
    p.add_argument("--all", action="store_true", help="gc: remove every namespace")
    p = add("replay", cmd_replay, "replay a workload through a real TieredKVCache (the main job)")
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--trace", help="Mooncake-format JSONL; default: the built-in multi-turn chat workload")
    p.add_argument("--max-requests", type=int)
    p.add_argument("--block-bytes", help="synthetic KV block size, e.g. 16KiB")
    p.add_argument("--concurrency", type=int)
    p.add_argument("--speed", type=float, help="pace by trace timestamps divided by this (0: as fast as possible)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on 127.0.0.1:PORT while running")
    p.add_argument("--plot", help="sweep capacities and draw hit rate vs capacity to this PNG")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--keep-disk", action="store_true",
        help="use tiers.disk.path as is (reuse blocks of earlier runs) instead of a fresh replay-<pid> subdirectory",
    )
    p = add("bench", cmd_bench, "throughput ratios against the raw operation, in one run")
    p.add_argument("--quick", action="store_true", help="fewer repeats (for tests)")
    p.add_argument("--only", choices=["transfer", "cache", "lookup", "index", "disk", "gpu"], action="append")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except TieredKVError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
