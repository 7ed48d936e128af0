"""The ``tiered-kv`` command. Every subcommand takes ``--json``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from typing import Any, NoReturn

from .errors import TieredKVError
from .replay.sizing import SHARE_SPLIT_HELP

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
        if not args.json:
            raise  # main prints the one line
        print(json.dumps({"ok": False, "error": str(exc)}))
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
    # Everything printed from the file system or the command line goes through display_text: a
    # namespace.json can carry terminal escape sequences (model_id "\x1b[31m..."), never sent raw.
    from .tiers.disk.admin import display_text, list_namespaces, remove_namespaces

    try:
        infos = list_namespaces(args.path)
    except OSError as exc:
        print(f"error: cannot list {display_text(args.path)}: {display_text(exc.strerror or exc)}", file=sys.stderr)
        return 2
    if args.action == "ls":
        rows = [dataclasses.asdict(i) for i in infos]
        _emit(args, rows, _render_namespaces)
        return 0
    chosen = [i.dirname for i in infos if args.all or i.dirname in args.names]
    unknown = set(args.names) - {i.dirname for i in infos}
    if unknown:
        names = ", ".join(display_text(n) for n in sorted(unknown))
        print(f"no such namespace under {display_text(args.path)}: {names}", file=sys.stderr)
        return 2
    removed = remove_namespaces(args.path, chosen)
    _emit(args, {"removed": removed},
          lambda p: print("\n".join(f"removed {display_text(d)}" for d in p["removed"]) or "nothing removed"))
    return 0


def _render_namespaces(rows: list[dict[str, Any]]) -> None:
    from .sizes import format_size
    from .tiers.disk.admin import display_text

    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:  # the core install has no rich (extra `cli`): one escaped line per namespace
        for r in rows:
            fields = [r["dirname"], *(str(r.get(f, "")) for f in ("model_id", "revision", "shard", "dtype",
                                                                 "layout_digest", "problem"))]  # fmt: skip
            print("  ".join(display_text(f) for f in fields if f))
        return

    def cell(value: object) -> Text:  # Text, not str: rich would read "[red]" in a model id as markup
        return Text(display_text(value))

    extra = [f for f in ("revision", "shard") if any(r.get(f) for r in rows)]  # shown when some row has one
    table = Table("namespace", "model", *extra, "dtype", "layout", "bytes/block", "blocks", "size")
    for col in table.columns:
        col.overflow = "fold"  # wrap long values, never cut them
    # `disk gc` needs the name exactly as listed: never shrunk, wrapped or cut.
    table.columns[0].no_wrap = True
    table.columns[0].min_width = max((len(r["dirname"]) for r in rows), default=9)
    damaged = [r for r in rows if r.get("problem")]
    for r in rows:
        if r.get("problem"):
            continue
        blocks = r.get("blocks", -1)
        table.add_row(
            cell(r["dirname"]), cell(r["model_id"]), *(cell(r.get(f, "")) for f in extra), cell(r["dtype"]),
            cell(r["layout_digest"]), str(r["bytes_per_block"]), str(blocks) if blocks >= 0 else "?",
            format_size(int(r.get("size_bytes", 0))),
        )
    if len(damaged) < len(rows) or not rows:
        Console().print(table)
    for r in damaged:  # plain lines: the reason may be long, and the name must stay whole
        print(f"{r['dirname']}: {display_text(r['problem'])} ({format_size(int(r.get('size_bytes', 0)))}); "
              f"`tiered-kv disk gc PATH {r['dirname']}` removes it")


def cmd_replay(args: argparse.Namespace) -> int:
    from .replay.cli import run_replay_cli

    return run_replay_cli(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_bench_cli

    return run_bench_cli(args)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error: ``tiered-kv: error: ...`` and exit status 2, no usage block."""

    def error(self, message: str) -> NoReturn:
        sub = self.prog.removeprefix("tiered-kv").strip()
        where = f"{sub}: " if sub else ""
        self.exit(2, f"tiered-kv: error: {where}{_one_line(message)} (see {self.prog} --help)\n")


def _ranged(kind: type, what: str, ok, refusal: str):
    """An argparse type: ``kind(text)`` (else "is not {what}") that ``ok`` accepts (else ``refusal``)."""

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not ok(value):  # NaN fails every comparison, so it is refused too
            raise argparse.ArgumentTypeError(refusal.format(value=value, text=text))
        return value

    return convert


_port = _ranged(int, "a port number", lambda v: 1 <= v <= 65535, "{value} is not a TCP port (1-65535)")
_share = _ranged(float, "a number", lambda v: 0 < v <= 1, "{text} is not a share: use 0 < F <= 1 (0.05 for 5 %)")
_instances = _ranged(int, "a whole number", lambda v: 1 <= v <= 64, "{value} instances: use 1 to 64")


def _one_line(text: str) -> str:
    # One line on stderr whatever a message holds (a YAML excerpt, a path with a newline).
    return " ".join(text.split())


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tiered-kv", description="Tiered KV-cache offload: plan, replay, bench.")
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
    p.add_argument("--metrics-port", type=_port, help="serve Prometheus metrics on 127.0.0.1:PORT while running")
    p.add_argument(
        "--plot", metavar="PATH",
        help="also replay at capacity shares 1, 5, 10, 25%% (split as --capacity-share) with every eviction "
             "policy, and draw hit rate vs capacity beside flat LRU and Belady to this PNG (takes minutes on a "
             "large trace)",
    )
    p.add_argument("--capacity-share", type=_share, metavar="F", help=SHARE_SPLIT_HELP)
    p.add_argument("--policy", metavar="NAME", help="eviction policy, overriding eviction.policy (e.g. lru, arc, window)")
    p.add_argument(
        "--hints", action=argparse.BooleanOptionalAction, default=None,
        help="pass the workload's sessions to the cache as hints (replay.hints; the built-in workload has sessions)",
    )
    p.add_argument(
        "--keep-partial", action="store_true",
        help="also store a request's partial last block (replay.drop_partial: false); by default it is dropped",
    )
    p.add_argument(
        "--instances", type=_instances, metavar="N",
        help="replay.instances: N serving instances (each its own GPU, CPU and disk tiers, capacities and "
             "concurrency per instance) sharing tiers.remote, which must be enabled for N > 1",
    )
    p.add_argument(
        "--route", choices=["round_robin", "session"],
        help="replay.route: send requests to instances round-robin, or keep a session's turns on one instance",
    )
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--keep-disk", action="store_true",
        help="use tiers.disk.path (and tiers.remote.key_prefix) as is, reusing blocks of earlier runs, instead "
             "of a fresh replay-<pid> subdirectory (and a fresh key prefix, removed afterwards)",
    )
    p = add("bench", cmd_bench, "throughput ratios against the raw operation, in one run")
    p.add_argument("--quick", action="store_true", help="a fast smoke run: smaller cases, same method (for tests)")
    p.add_argument("--only", choices=["cache", "disk", "lookup", "memory", "host", "inflight", "call_cost", "gpu"], action="append",
                   help="run only this section (repeatable); default: all, gpu where CUDA is available")
    p.add_argument("--dir", help="directory for the disk section's files (default: the system temp directory)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 ok, 1 the replay saw corrupt blocks, 2 bad input (one line on stderr), 130 Ctrl-C."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error, already printed on one line (2)
        return exc.code if isinstance(exc.code, int) else 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        rc = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        return rc
    except TieredKVError as exc:
        print(f"tiered-kv: error: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader (``| head``) has gone: stop quietly. Point stdout at /dev/null so the
        # interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a command killed by the closed pipe
    except KeyboardInterrupt:
        print("tiered-kv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
