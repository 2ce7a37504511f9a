"""The agent's checkpoint worker processes (``ckpt_worker``): started on demand, niced, kept.

At most ``limit`` checkpoints of the agent's ranks are dumped and uploaded at once (a dump
whose pipe nobody reads stands still, so the limit covers both), each by a worker process of
its own. A worker that finished a task, well or not, waits for the next: starting one costs
0.4 s of CPU (the interpreter and its imports), more than a third of a checkpoint's own. The
agent starts one when it finds CRIU (``prewarm``), the others come at the first checkpoint
that needs them. A worker starts at the agent's priority and lowers its own once imported
(``checkpoint_nice``). A worker that broke (it died, or said something unexpected) or whose
checkpoint was cancelled is killed with its process group (CRIU with it) and replaced at the
next checkpoint.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable

import trio

from vpool.protocol.errors import ErrorCode
from vpool.worker_agent import criu
from vpool.worker_agent.ckpt_worker import (
    Acked,
    Done,
    Dumped,
    Failed,
    FromWorker,
    LinkReader,
    Task,
    WantAck,
    WorkerProtocolError,
    frame,
)
from vpool.worker_agent.errors import AgentError
from vpool.worker_agent.store_client import StoreError

log = logging.getLogger("vpool.agent")

COMMAND = [sys.executable, "-m", "vpool.worker_agent.ckpt_worker"]


class WorkerFailed(AgentError):
    """The checkpoint failed for a reason other than CRIU's or the store's."""


class _Worker:
    def __init__(self, proc: trio.Process) -> None:
        assert proc.stdin is not None and proc.stdout is not None
        self.proc = proc
        self.stdin = proc.stdin
        self.reader = LinkReader(proc.stdout, FromWorker)

    @classmethod
    async def start(cls, nice: int) -> _Worker:
        proc = await trio.lowlevel.open_process(
            [*COMMAND, str(nice)],  # it lowers its priority itself, once imported
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            # Its own group, so that killing it kills CRIU too; in the agent's session (one
            # scheduler autogroup with the ranks: docs/internals.md, "Niceness").
            process_group=0,
        )
        return cls(proc)

    async def run(
        self, task: Task, dumped: Callable[[float], None], acked: Callable[[], Awaitable[None]]
    ) -> Done | Failed:
        await self.stdin.send_all(frame(task))
        refused: BaseException | None = None
        while True:
            msg = await self.reader.next()
            if msg is None:
                raise WorkerProtocolError(
                    f"the checkpoint worker (pid {self.proc.pid}) ended in the middle of a task"
                )
            if isinstance(msg, Dumped):
                dumped(msg.seconds)
            elif isinstance(msg, WantAck):
                try:
                    await acked()
                except Exception as exc:
                    refused = exc
                    await self.stdin.send_all(frame(Acked(error=str(exc) or "refused")))
                else:
                    await self.stdin.send_all(frame(Acked()))
            elif isinstance(msg, Done | Failed):
                if refused is not None:
                    raise refused  # the worker failed because of it: the agent's reason
                return msg
            else:  # pragma: no cover (FromWorker is exhaustive)
                raise WorkerProtocolError(f"unexpected {type(msg).__name__}")

    def kill(self) -> None:
        """Kill the worker's process group (the worker and CRIU), by the worker's pid: it leads
        the group (``process_group=0``), and it is not reaped before ``wait``. The worker
        itself also by its pid, so that ``close`` never waits for a live one."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.kill()

    async def close(self) -> None:
        with trio.CancelScope(shield=True):
            self.kill()
            await self.proc.wait()
            await self.stdin.aclose()
            if self.proc.stdout is not None:
                await self.proc.stdout.aclose()


class CkptWorkers:
    """Checkpoint workers of one agent (module docstring)."""

    def __init__(self, nice: int, limit: int = 2) -> None:
        self.nice = nice
        self.limiter = trio.CapacityLimiter(limit)
        self._idle: list[_Worker] = []
        self.started = 0  # workers started so far

    @property
    def idle_pids(self) -> list[int]:
        return [w.proc.pid for w in self._idle]

    async def run(
        self,
        task: Task,
        *,
        dumped: Callable[[float], None],
        acked: Callable[[], Awaitable[None]],
    ) -> int:
        """Dump and store ``task`` in a worker; the image's size. ``dumped(seconds)`` is called
        once CRIU is done with the clone, ``acked()`` before the image's end is sent (its
        exception fails the checkpoint). Raises ``criu.CriuError``, ``StoreError`` or
        ``WorkerFailed``."""
        async with self.limiter:
            worker = self._idle.pop() if self._idle else await self._start()
            keep = False
            try:
                result = await worker.run(task, dumped, acked)
                keep = True
            except WorkerProtocolError as exc:
                raise WorkerFailed(str(exc)) from exc
            finally:
                if keep:
                    self._idle.append(worker)
                else:
                    await worker.close()
        if isinstance(result, Failed):
            if result.kind == "criu":
                raise criu.CriuError(result.message)
            if result.kind == "store":
                raise StoreError(result.message, result.code or ErrorCode.LINK_BROKEN)
            raise WorkerFailed(result.message)
        return result.size

    async def _start(self) -> _Worker:
        worker = await _Worker.start(self.nice)
        self.started += 1
        log.debug("checkpoint worker %d started", worker.proc.pid)
        return worker

    async def prewarm(self) -> None:
        """Start a worker now (the agent found CRIU), for the first checkpoint."""
        if not self._idle:
            self._idle.append(await self._start())

    async def aclose(self) -> None:
        """End the idle workers (a busy one ends with its cancelled checkpoint)."""
        idle, self._idle = self._idle, []
        for worker in idle:
            await worker.close()
