"""The peers bench's processes: engines and LMCache's server in process groups of their own, and /dev/shm sweeps.

Everything the bench starts runs with ``start_new_session=True`` and is killed as a group (vLLM's
EngineCore and TP workers, the server's own children) when its block exits, on failure too.
LMCache's ``lmcache_driven`` mode puts the engine's KV tensors in ``lmcache_kv_*`` segments, and a
TP engine leaves ``vllm_dist_*`` ones; ``ShmSweep`` removes the entries of those names that
appeared since it started, are at least ``min_age_s`` old and that no live process has open or
mapped (the machine is shared: another engineer's engine may have just made one, not yet mapped).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

# Never tkv-*: tiered_kv removes its own segments, and tkv-<euid>.lock is shared by every engine of the user.
SHM_PREFIXES = ("lmcache_kv_", "vllm_dist_")


def kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM the process group, SIGKILL it after ``grace_s``; children that outlive the leader die too."""
    try:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


@contextmanager
def group(cmd: Sequence[str], **popen) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(list(cmd), start_new_session=True, **popen)
    try:
        yield proc
    finally:
        kill_group(proc)


def run_engine(cmd: Sequence[str], timeout_s: float, cwd: Path, env: dict | None = None,
               log: Path | None = None) -> dict:  # fmt: skip
    """Run one engine script; its ``ENGINE_REPORT`` line, or RuntimeError with its output's tail.

    ``log``: where its whole stderr goes (vLLM's and LMCache's logging), kept for a post-mortem.
    """
    timed_out = False
    with group(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            out, err = proc.communicate()
            timed_out = True
    if log is not None:
        log.write_text(err)
    if timed_out:
        raise RuntimeError(f"engine still running after {timeout_s:.0f} s: killed")
    for line in out.splitlines():
        if line.startswith("ENGINE_REPORT ") and proc.returncode == 0:
            return json.loads(line[len("ENGINE_REPORT ") :])
    where = f" (whole log: {log})" if log is not None else ""
    raise RuntimeError(f"engine exited {proc.returncode} without a report{where}:\n{err[-3000:]}")


def held_paths(proc_root: Path = Path("/proc")) -> set[str]:
    """Every path some live process has open (fd) or mapped (maps)."""
    held: set[str] = set()
    for pid in proc_root.iterdir():
        if not pid.name.isdigit():
            continue
        held |= open_paths(int(pid.name), proc_root)
        try:
            for line in (pid / "maps").read_text().splitlines():
                parts = line.split(None, 5)
                if len(parts) == 6:
                    held.add(parts[5])
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return held


def open_paths(pid: int, proc_root: Path = Path("/proc")) -> set[str]:
    """The paths process ``pid`` has open. An fd closed between the listing and its readlink is skipped
    alone: a process opening and closing other files still holds the ones it keeps."""
    paths: set[str] = set()
    try:
        fds = list((proc_root / str(pid) / "fd").iterdir())
    except OSError:  # gone, or not ours to read
        return paths
    for fd in fds:
        try:
            paths.add(os.readlink(fd))
        except OSError:
            continue
    return paths


class ShmSweep:
    """Remove the entries of ``prefixes`` that appeared in ``root`` since construction and nobody holds."""

    def __init__(self, root: Path = Path("/dev/shm"), prefixes: Sequence[str] = SHM_PREFIXES,
                 min_age_s: float = 5.0) -> None:  # fmt: skip
        self.root, self.prefixes, self.min_age_s = root, tuple(prefixes), min_age_s
        self.before = set(os.listdir(root))
        self.removed: list[str] = []

    def sweep(self) -> list[str]:
        new = [n for n in os.listdir(self.root) if n not in self.before and n.startswith(self.prefixes)]
        if not new:
            return []
        held = held_paths()
        gone = []
        for name in new:
            path = self.root / name
            try:
                if str(path) in held or time.time() - path.stat().st_mtime < self.min_age_s:
                    continue
                path.unlink()
            except FileNotFoundError:
                continue
            gone.append(name)
        self.removed += gone
        return gone


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class LMCacheServer:
    """LMCache's multi-process server (ZMQ for the connector, HTTP for control), chunk 32, DRAM L1 only."""

    def __init__(self, python: str, log: Path, chunk: int = 32, l1_gb: int = 1, workers: int = 1) -> None:
        # ``workers``: one store/retrieve thread per TP rank. With the default single thread, a TP=2
        # engine's two ranks share it and each rank's store waits there behind the other's (stores
        # of tens of seconds, pings unanswered, the connector "degraded"; LMCache warns of it).
        self.port, self.http_port = free_port(), free_port()
        self.cmd = [python, "-m", "lmcache.v1.multiprocess.http_server", "--host", "localhost",
                    "--port", str(self.port), "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
                    "--chunk-size", str(chunk), "--disable-observability", "--eviction-policy", "LRU",
                    "--l1-size-gb", str(l1_gb), "--l1-init-size-gb", str(l1_gb),
                    "--worker-reap-timeout-seconds", "600", "--max-workers", str(workers)]  # fmt: skip
        self.log = log
        self._cm = None
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LMCacheServer:
        # One OpenMP thread: the engine's ranks already spin on every core the binding gives them, and
        # an OpenMP team whose threads wait for a core stalls the server's copies.
        env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "OMP_NUM_THREADS": "1"}
        self._log_f = open(self.log, "ab")  # noqa: SIM115  (closed in __exit__)
        self._cm = group(self.cmd, stdout=self._log_f, stderr=subprocess.STDOUT, env=env)
        self.proc = self._cm.__enter__()
        try:
            self._wait_healthy()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._cm is not None:
            self._cm.__exit__(None, None, None)
            self._cm = None
        self._log_f.close()

    def _http(self, method: str, path: str, body: dict | None = None, timeout: float = 10.0) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.http_port}{path}", method=method, data=data,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read() or b"{}")

    def _wait_healthy(self, limit_s: float = 180.0) -> None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < limit_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"LMCache server exited {self.proc.returncode} at start: see {self.log}")
            try:
                if self._http("GET", "/healthcheck", timeout=2).get("status") == "healthy":
                    return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError(f"LMCache server not healthy after {limit_s:.0f} s: see {self.log}")

    def clear(self) -> None:
        """``POST /cache/clear``, forced (the previous engine is gone): nothing it stored is hit by the next."""
        reply = self._http("POST", "/cache/clear", {"tier": "l1", "force": True})
        if reply.get("status") != "ok":
            raise RuntimeError(f"LMCache server refused /cache/clear: {reply}")

    def rss_mib(self) -> float | None:
        return rss_mib(self.proc.pid) if self.proc else None
