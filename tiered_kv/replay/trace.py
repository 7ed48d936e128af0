"""Mooncake-format JSONL traces -> Request objects.

One JSON object a line: ``{"timestamp": ms, "input_length": n, "output_length": n,
"hash_ids": [int, ...]}``. ``hash_ids`` are chained prefix block ids: an id names a
block together with every token before it, so equal ids mean equal prefixes.
Every malformed line raises TraceError naming ``source:lineno`` and the fault, so a
bad line in a 100k-line file can be found without a debugger.

Bounds, so that one hostile line cannot take minutes or gigabytes: a line is at most
MAX_LINE_BYTES (checked before JSON parsing; the reader never holds more than that),
``hash_ids`` at most MAX_HASH_IDS ids, each a 64-bit unsigned value, and a
timestamp at most MAX_TIMESTAMP_MS.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from tiered_kv.errors import TraceError

__all__ = ["MAX_HASH_IDS", "MAX_LINE_BYTES", "MAX_TIMESTAMP_MS", "Request", "parse_trace_lines", "read_trace"]

MAX_LINE_BYTES = 4 << 20  # 4 MiB: MAX_HASH_IDS ids of 20 digits fit with room to spare
MAX_HASH_IDS = 1 << 17  # 131072 blocks of 512 tokens: a 64M-token context
MAX_HASH_ID = (1 << 64) - 1  # hash_ids are unsigned 64-bit hashes
MAX_TIMESTAMP_MS = float(1 << 53)  # ~285,000 years of ms; every integer below it is an exact float


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace: arrival time, token counts and its prefix block ids."""

    timestamp_ms: float
    input_length: int  # tokens
    output_length: int  # tokens
    hash_ids: tuple[int, ...]  # chained prefix block ids
    # Sessions (the built-in chat workload sets them; a trace has none): the frontend's
    # knowledge of which conversation a request continues, and whether it is its last turn.
    session: int | None = None
    last_turn: bool = False


def _is_int(value: object) -> bool:
    # bool is a subclass of int; `true` in a trace is a bug, not the number 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _field(obj: dict, key: str, where: str) -> object:
    if key not in obj:
        raise TraceError(f"{where}: missing field {key!r}")
    return obj[key]


def _short(value: object, typed: bool = False) -> str:
    """A value for an error message: bounded in length (a huge int or a nested list stays short)."""
    if _is_int(value) and abs(value) >= 10**24:  # type: ignore[arg-type]
        return f"an integer of about 2^{abs(value).bit_length() - 1}"  # type: ignore[arg-type]
    if isinstance(value, (dict, list)):
        return f"a JSON {'object' if isinstance(value, dict) else 'array'}"
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{type(value).__name__} {text}" if typed else text


def _non_negative_int(obj: dict, key: str, where: str) -> int:
    value = _field(obj, key, where)
    if not _is_int(value):
        raise TraceError(f"{where}: field {key!r} must be an integer, got {_short(value, typed=True)}")
    if value < 0:
        raise TraceError(f"{where}: field {key!r} must be >= 0, got {_short(value)}")
    if value > MAX_HASH_ID:
        raise TraceError(f"{where}: field {key!r} must be < 2^64, got {_short(value)}")
    return value


def _parse_line(text: str, where: str) -> Request:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise TraceError(f"{where}: invalid JSON (nested too deeply)") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise TraceError(f"{where}: invalid JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")

    ts = _field(obj, "timestamp", where)
    # Timestamps may be fractional ms; NaN/inf cannot be produced by strict JSON but
    # Python's json accepts them, so reject them explicitly.
    if not (_is_int(ts) or isinstance(ts, float)) or ts != ts or ts in (float("inf"), float("-inf")):
        raise TraceError(f"{where}: field 'timestamp' must be a finite number, got {_short(ts)}")
    if ts < 0:
        raise TraceError(f"{where}: field 'timestamp' must be >= 0, got {_short(ts)}")
    if ts > MAX_TIMESTAMP_MS:
        raise TraceError(f"{where}: field 'timestamp' must be <= 2^53 ms, got {_short(ts)}")

    input_length = _non_negative_int(obj, "input_length", where)
    output_length = _non_negative_int(obj, "output_length", where)

    raw_ids = _field(obj, "hash_ids", where)
    if not isinstance(raw_ids, list):
        raise TraceError(f"{where}: field 'hash_ids' must be a list, got {type(raw_ids).__name__}")
    if len(raw_ids) > MAX_HASH_IDS:
        raise TraceError(f"{where}: hash_ids has {len(raw_ids)} ids, over the maximum of {MAX_HASH_IDS}")
    for i, h in enumerate(raw_ids):
        if not _is_int(h):
            raise TraceError(f"{where}: hash_ids[{i}] must be an integer, got {_short(h, typed=True)}")
        if h < 0:
            raise TraceError(f"{where}: hash_ids[{i}] must be >= 0, got {_short(h)}")
        if h > MAX_HASH_ID:
            raise TraceError(f"{where}: hash_ids[{i}] must be < 2^64 (an unsigned 64-bit hash), got {_short(h)}")

    return Request(
        timestamp_ms=float(ts),
        input_length=input_length,
        output_length=output_length,
        hash_ids=tuple(raw_ids),
    )


def parse_trace_lines(
    lines: Iterable[str | bytes], source: str = "<trace>", max_requests: int | None = None
) -> list[Request]:
    """Parse JSONL lines into Requests; blank lines are skipped, extra keys ignored.

    Stops after ``max_requests`` requests (None: all). Raises TraceError naming
    ``source:lineno`` for any malformed line.
    """
    if max_requests is not None and (not _is_int(max_requests) or max_requests < 0):
        raise TraceError(f"{source}: max_requests must be a non-negative integer, got {max_requests!r}")
    requests: list[Request] = []
    if max_requests == 0:
        return requests
    for lineno, line in enumerate(lines, start=1):
        where = f"{source}:{lineno}"
        if len(line) > MAX_LINE_BYTES and len(line.rstrip(b"\r\n" if isinstance(line, bytes) else "\r\n")) > MAX_LINE_BYTES:
            raise TraceError(f"{where}: line longer than {MAX_LINE_BYTES} bytes (MAX_LINE_BYTES); refused unparsed")
        if isinstance(line, bytes):
            # read_trace hands over bytes so a bad encoding still names its line.
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
        text = line.strip()
        if not text:
            continue
        requests.append(_parse_line(text, where))
        if max_requests is not None and len(requests) >= max_requests:
            break
    return requests


def _bounded_lines(fh: BinaryIO) -> Iterator[bytes]:
    """Lines of ``fh``, but never more than MAX_LINE_BYTES + 1 bytes of one line in memory:
    an overlong line is handed on cut short, so the parser refuses it by its length."""
    while line := fh.readline(MAX_LINE_BYTES + 1):
        yield line
        while len(line) > MAX_LINE_BYTES and not line.endswith(b"\n"):
            line = fh.readline(MAX_LINE_BYTES + 1)  # skip the rest (only if the caller reads on)


def read_trace(path: str | os.PathLike, max_requests: int | None = None) -> list[Request]:
    """Read a Mooncake-format JSONL trace file; raises TraceError for a missing or bad file."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as fh:
            return parse_trace_lines(_bounded_lines(fh), source=source, max_requests=max_requests)
    except FileNotFoundError as exc:
        raise TraceError(f"{source}: trace file not found") from exc
    except IsADirectoryError as exc:
        raise TraceError(f"{source}: trace path is a directory, not a file") from exc
    except PermissionError as exc:
        raise TraceError(f"{source}: permission denied reading trace file") from exc
