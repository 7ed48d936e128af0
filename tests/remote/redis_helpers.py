"""Helpers of tests/remote: real redis-server processes on loopback, keys, block bytes, configs."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np

from tiered_kv.metrics import CacheMetrics
from tiered_kv.tier_config import RemoteTierConfig
from tiered_kv.tiers.cpu import CpuSlabs

REDIS = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
NO_REDIS = "no redis-server binary on PATH: install it (apt-get install -y redis-server; .ci/run does so)"
BPB = 8192 + 512  # two regions, like a small layout
SLOTS = 64


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(cluster: bool = False) -> int:
    """A free loopback port; for a cluster node also its bus port (+10000, so below 55536)."""
    if not cluster:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    rng = random.Random()
    while True:
        port = rng.randint(20000, 45000)
        if _bindable(port) and _bindable(port + 10000):
            return port


def wait_ready(port: int, proc: subprocess.Popen, deadline: float = 10.0) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server on port {port} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):
                    return
        except OSError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"redis-server on port {port} not ready after {deadline} s")


class RedisServer:
    """One redis-server process; ``kill``/``restart``/``pause``/``resume`` for the fault tests."""

    def __init__(self, workdir: Path, port: int | None = None, extra: tuple[str, ...] = ()) -> None:
        self.dir, self.port, self.extra = workdir, port or free_port(), extra
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.dir.mkdir(parents=True, exist_ok=True)
        args = [REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.dir), "--protected-mode", "no", *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_ready(self.port, self.proc)
        except BaseException:
            self.kill()  # never leave a server behind
            raise
        return self

    def cli(self, *args: str) -> str:
        out = subprocess.run([REDIS_CLI, "-p", str(self.port), *args], capture_output=True, timeout=10)
        return out.stdout.decode(errors="replace").strip()

    def raw(self, *args: bytes) -> bytes:
        """One command over a plain socket (binary-safe values, unlike redis-cli arguments)."""
        cmd = b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as s:
            s.sendall(cmd)
            return s.recv(1 << 16)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


def remote_cfg(url: str, **kw) -> RemoteTierConfig:
    return RemoteTierConfig(enabled=True, url=url, **{"timeout": 0.5, **kw})


def key_rows(tag: str, n: int, start: int = 0, kb: int = 32) -> np.ndarray:
    return np.frombuffer(b"".join(hashlib.sha256(b"%s/%d" % (tag.encode(), i)).digest()[:kb]
                                  for i in range(start, start + n)), np.uint8).reshape(n, kb)


def block_bytes(key: bytes) -> np.ndarray:
    """The bytes a block with this key holds: derived from the key, so any mix-up shows."""
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, BPB, dtype=np.uint8)


def fill(slabs: CpuSlabs, slots, keys: np.ndarray) -> None:
    for s, k in zip(slots, keys, strict=True):
        slabs.slab_np[s] = block_bytes(k.tobytes())


def metrics() -> CacheMetrics:
    return CacheMetrics()


def count(m: CacheMetrics, op: str, result: str) -> float:
    return m.snapshot().get(f"tiered_kv_remote_blocks_total{{{op},{result}}}", 0)


def env_without(name: str) -> dict:
    return {k: v for k, v in os.environ.items() if k != name}


def pool_in_use(store) -> int:
    """Pooled connections a RemoteStore's batch holds now (0 when idle)."""
    return store._conns.in_use()
