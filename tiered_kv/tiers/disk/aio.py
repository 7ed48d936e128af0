"""The disk tier's file I/O off the event loop: aiofiles, on the tier's own thread pool.

Files are opened and closed with ``aiofiles.open`` (relative to the checked namespace directory, through
an opener that keeps files.py's checks: no links, no FIFOs, ours, one link), ``stat`` / ``unlink`` /
``replace`` go through ``aiofiles.os``, and what aiofiles has no call for (``fsync``, ``fdatasync``, the
batch jobs) through its own wrapper, ``aiofiles.os.wrap`` (``DiskCalls.run``). Every call names the tier's
executor (``tiers.disk.io_threads`` threads), so the thread count holds and a batch is ONE hand-off: a
write batch's job (batch_job.py) appends its invalidations to the journal's fd, issues one vectored
``pwritev`` per run of consecutive slots (records.py), then appends its commits, all from that one thread;
a read batch's job one ``preadv`` per run. Never a thread (or a hop) per record or per append.

Cancelling an await does not stop a call already on a thread, so ``DiskCalls.shielded`` runs a multi-step
protocol as a task of its own that the caller waits for, cancelled or not, and ``drain`` lets ``aclose``
wait for every such task before the files close under them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import aiofiles
import aiofiles.os
from aiofiles.threadpool.binary import AsyncFileIO

from ...owned_tasks import wait_to_end
from .files import create_fresh, open_private

T = TypeVar("T")


class DiskCalls:
    """aiofiles calls bound to one executor, plus the tasks of the protocols in flight."""

    def __init__(self, threads: int) -> None:
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="tkv-disk")
        self._jobs: set[asyncio.Task[Any]] = set()

    # ---- calls ---------------------------------------------------------------------------------------
    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the tier's executor through ``aiofiles.os.wrap``: one hand-off."""
        return await aiofiles.os.wrap(fn)(*args, executor=self.executor, **kwargs)

    async def open(self, name: str, *, dir_fd: int, path: str,
                   opener: Callable[[str], int] | None = None) -> AsyncFileIO:  # fmt: skip
        """``aiofiles.open`` of ``name`` under ``dir_fd`` read-write, unbuffered; by default one of our
        private files (created 0600 when missing), else whatever fd ``opener(name)`` returns."""
        def open_fd(n: str, _flags: int) -> int:
            return opener(n) if opener is not None else open_private(n, dir_fd=dir_fd, path=path)

        return await aiofiles.open(name, "r+b", buffering=0, opener=open_fd, executor=self.executor)

    async def stat(self, fd: int) -> os.stat_result:
        return await aiofiles.os.stat(fd, executor=self.executor)

    async def unlink(self, name: str, *, dir_fd: int) -> None:
        await aiofiles.os.unlink(name, dir_fd=dir_fd, executor=self.executor)

    async def fsync(self, fd: int) -> None:
        await self.run(os.fsync, fd)

    async def fdatasync(self, fd: int) -> None:
        await self.run(os.fdatasync, fd)

    async def write_all(self, f: AsyncFileIO, data: bytes | memoryview) -> None:
        """Write all of ``data`` at ``f``'s position (an unbuffered write may be short: go on from there)."""
        mv, done = memoryview(data), 0
        while done < len(mv):
            n = await f.write(mv[done:])
            if not n:
                raise OSError(0, f"write made no progress at byte {done} of {len(mv)}")
            done += n

    async def replace_file(self, dir_fd: int, dirpath: str, name: str, data: bytes) -> AsyncFileIO:
        """Durably replace ``name`` with ``data``: a fresh temp file, fsync, rename over, fsync the directory.
        Returns the new file, open, positioned at its end."""
        tmp = name + ".tmp"
        f = await self.open(tmp, dir_fd=dir_fd, path=os.path.join(dirpath, tmp), opener=lambda n: create_fresh(
            n, dir_fd=dir_fd, path=os.path.join(dirpath, tmp)))  # fmt: skip
        try:
            await self.write_all(f, data)
            await self.fsync(f.fileno())
            await aiofiles.os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, executor=self.executor)
        except BaseException:
            await f.close()
            try:
                await self.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            raise
        await self.fsync(dir_fd)
        return f

    # ---- protocols in flight -------------------------------------------------------------------------
    async def shielded(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` to its end even if the caller is cancelled (who then gets CancelledError after it)."""
        task = asyncio.ensure_future(coro)
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)
        return await wait_to_end(task)

    async def drain(self) -> None:
        """Wait for every protocol in flight (their errors belong to their callers)."""
        while self._jobs:
            await asyncio.wait(list(self._jobs))

    async def shutdown(self) -> None:
        # shutdown(wait=True) joins the pool's threads, so it cannot run inside the pool itself.
        await asyncio.to_thread(self.executor.shutdown, True)
