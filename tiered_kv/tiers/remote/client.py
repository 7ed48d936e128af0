"""Connections to Redis or Redis Cluster: bounded pools and one pipelined round trip per batch and server.

redis-py (with hiredis) connects, authenticates and parses replies; batching is ours. A batch is one
``send_packed_command`` of protocol chunks we build (so a SET can send a slab row as a memoryview,
with no copy) followed by reading its replies in order. Any failure or cancellation between the send
and the last reply discards that connection (the transport is aborted, so no queued bytes from slab
rows go out later, and no half-read reply is ever handed to the next batch). Cluster batches are
split by the node that owns each key's slot and sent to all nodes at once.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import Any

from ...errors import ConfigError, RemoteError
from ...tier_config import RemoteTierConfig

try:
    from redis.asyncio import ConnectionPool
    from redis.asyncio.cluster import ClusterNode, RedisCluster
    from redis.asyncio.retry import Retry  # the asyncio client's own (not a converted sync one)
    from redis.backoff import NoBackoff
    from redis.crc import key_slot
    from redis.exceptions import OutOfMemoryError, ResponseError  # noqa: F401 - OutOfMemoryError: for store.py
except ImportError as e:  # an extra: say how to get it instead of a bare ModuleNotFoundError
    raise RemoteError(f"tiers.remote needs redis-py: pip install 'tiered_kv[remote]' ({e})") from e
from ...redis_url import redact, split_node

Reply = Any  # bytes, int, None, or the ResponseError the server answered


class Node:
    """One server: at most ``limit`` batches in flight, each on its own pooled connection."""

    def __init__(self, name: str, acquire: Callable[[], Awaitable[Any]], release: Callable[[Any], Awaitable[None]],
                 limit: int) -> None:  # fmt: skip
        self.name = name
        self._acquire, self._release = acquire, release
        self._sem = asyncio.Semaphore(limit)
        self.in_use = 0  # connections taken and not yet handed back (0 when idle: the load test checks it)

    async def round_trip(self, chunks: list, count: int, on_reply: Callable[[int, Reply], None]) -> None:
        """Send ``chunks`` (``count`` commands) and hand each reply to ``on_reply(i, reply)`` in order.

        Raises for a connection fault, a timeout or cancellation, after discarding the connection.
        """
        async with self._sem:
            conn = await self._take()
            transport = None
            try:
                if not conn.is_connected:
                    await conn.connect()
                # redis-py keeps the StreamWriter private; without it we still discard, just less eagerly.
                transport = getattr(getattr(conn, "_writer", None), "transport", None)
                await conn.send_packed_command(chunks, check_health=False)
                for i in range(count):
                    try:
                        reply = await conn.read_response(disable_decoding=True)
                    except ResponseError as e:  # read in full: the connection is still in step
                        reply = e
                    on_reply(i, reply)
            except BaseException:
                if transport is not None:
                    transport.abort()  # drop queued chunks (views of slab rows) now, not after a flush
                await conn.disconnect(nowait=True)
                raise
            finally:
                await asyncio.shield(self._give(conn))

    async def _take(self) -> Any:
        # Shielded: a cancel while the pool hands out a connection must not lose that connection.
        task = asyncio.ensure_future(self._acquire())
        try:
            conn = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._give_back_late)
            raise
        self.in_use += 1
        return conn

    def _give_back_late(self, task: asyncio.Future) -> None:
        if not task.cancelled() and task.exception() is None:
            self.in_use += 1
            fut = asyncio.ensure_future(self._give(task.result()))
            fut.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _give(self, conn: Any) -> None:
        self.in_use -= 1
        await self._release(conn)


def _conn_kwargs(cfg: RemoteTierConfig, password: str | None) -> dict[str, Any]:
    # No retries inside redis-py: a fault degrades the tier and our own reconnect loop backs off.
    return {"socket_timeout": cfg.timeout, "socket_connect_timeout": cfg.timeout, "password": password,
            "retry": Retry(NoBackoff(), 0), "health_check_interval": 0}  # fmt: skip


def read_password(cfg: RemoteTierConfig) -> str | None:
    if cfg.password_env is None:
        return None
    value = os.environ.get(cfg.password_env)
    if value is None:
        raise ConfigError(f"tiers.remote.password_env: environment variable {cfg.password_env} is not set "
                          f"(the password for {redact(cfg.url)})")  # fmt: skip
    return value


class Connections:
    """The servers of one remote tier, single node or cluster, grouped per batch by key."""

    def __init__(self, cfg: RemoteTierConfig, password: str | None) -> None:
        self.cfg = cfg
        self.where = redact(cfg.url) if not cfg.cluster else f"cluster {cfg.nodes or [redact(cfg.url)]}"
        self._pool: ConnectionPool | None = None
        self._cluster: RedisCluster | None = None
        self._nodes: dict[str, Node] = {}
        kw = _conn_kwargs(cfg, password)
        if cfg.cluster:
            seeds = cfg.nodes or [f"{_host_port(cfg.url)}"]
            startup = [ClusterNode(*split_node(s)) for s in seeds]
            kw.pop("retry")
            self._cluster = RedisCluster(startup_nodes=startup, max_connections=cfg.max_concurrency,
                                         ssl=cfg.url.startswith("rediss:"), **kw)  # fmt: skip
        else:
            self._pool = ConnectionPool.from_url(cfg.url, max_connections=cfg.max_concurrency, **kw)
            self._nodes["single"] = Node(self.where, self._pool.get_connection, self._pool.release,
                                         cfg.max_concurrency)  # fmt: skip

    async def start(self) -> None:
        if self._cluster is not None:
            await self._cluster.initialize()

    def split(self, rkeys: list[bytes]) -> list[tuple[Node, list[int]]]:
        """The batch's key indexes per server (one group for a single node)."""
        if self._cluster is None:
            return [(self._nodes["single"], list(range(len(rkeys))))]
        groups: dict[str, tuple[Node, list[int]]] = {}
        manager = self._cluster.nodes_manager
        for i, k in enumerate(rkeys):
            cn = manager.get_node_from_slot(key_slot(k))
            if cn.name not in groups:
                groups[cn.name] = (self._node(cn), [])
            groups[cn.name][1].append(i)
        return list(groups.values())

    def nodes(self) -> list[Node]:
        if self._cluster is None:
            return [self._nodes["single"]]
        return [self._node(cn) for cn in self._cluster.get_primaries()]

    def _node(self, cn: ClusterNode) -> Node:
        node = self._nodes.get(cn.name)
        if node is None:
            async def acquire(name: str = cn.name) -> Any:  # the node object of the current topology
                return self._cluster.nodes_manager.nodes_cache[name].acquire_connection()

            async def release(conn: Any, name: str = cn.name) -> None:
                current = self._cluster.nodes_manager.nodes_cache.get(name)
                if current is not None:  # same name, same address: a refreshed node takes it back
                    current.release(conn)

            node = self._nodes[cn.name] = Node(cn.name, acquire, release, self.cfg.max_concurrency)
        return node

    async def refresh(self) -> None:
        """Drop idle connections (a restarted server left them dead); for a cluster, reload the topology."""
        if self._pool is not None:
            await self._pool.disconnect(inuse_connections=False)
        else:
            await self._cluster.nodes_manager.initialize()

    def in_use(self) -> int:
        return sum(n.in_use for n in self._nodes.values())

    async def aclose(self) -> None:
        if self._pool is not None:
            await self._pool.aclose()
        if self._cluster is not None:
            await self._cluster.aclose()


def _host_port(url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or 6379}"
