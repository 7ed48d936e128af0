"""Empty one namespace of the remote tier on every server: SCAN for its keys, UNLINK them.

Used by a reset (vLLM's ``reset_prefix_cache(reset_connector=True)`` after a weight update): the
blocks in Redis were computed with the old weights, and other instances sharing the namespace would
serve them too. UNLINK goes one key per command, pipelined, so a cluster never sees a cross-slot call.
"""

from __future__ import annotations

from typing import Any

from ...errors import RemoteError
from .client import Connections

SCAN_COUNT = 1000


def resp(*args: bytes) -> bytes:
    """One command in Redis's wire format."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def glob_escape(raw: bytes) -> bytes:
    """``raw`` as a literal inside a SCAN MATCH pattern."""
    out = bytearray()
    for c in raw:
        if c in b"*?[]\\":
            out += b"\\"
        out.append(c)
    return bytes(out)


async def purge_namespace(conns: Connections, prefix: bytes) -> int:
    """Delete every key that starts with ``prefix`` on every primary; returns how many were deleted.
    Raises RemoteError naming the server when one fails (the caller decides what a reset then is)."""
    pattern = glob_escape(prefix) + b"*"
    deleted = 0
    for node in conns.nodes():
        cursor = b"0"
        while True:
            scan = await _one(node, resp(b"SCAN", cursor, b"MATCH", pattern, b"COUNT", b"%d" % SCAN_COUNT))
            cursor, keys = bytes(scan[0]), list(scan[1])
            if keys:
                replies: list[Any] = []
                await node.round_trip([resp(b"UNLINK", bytes(k)) for k in keys], len(keys),
                                      lambda _i, r, out=replies: out.append(r))  # fmt: skip
                bad = [r for r in replies if isinstance(r, Exception)]
                if bad:
                    raise RemoteError(f"tiers.remote: UNLINK on {node.name} failed: {bad[0]}")
                deleted += sum(int(r) for r in replies)
            if cursor == b"0":
                break
    return deleted


async def _one(node: Any, command: bytes) -> Any:
    replies: list[Any] = []
    await node.round_trip([command], 1, lambda _i, r: replies.append(r))
    if isinstance(replies[0], Exception):
        raise RemoteError(f"tiers.remote: SCAN on {node.name} failed: {replies[0]}")
    return replies[0]
