"""The agent's checkpoint worker processes (``ckpt_workers``, ``ckpt_worker``): real processes,
with a stand-in for CRIU (a script) where a real dump is not the point."""

from __future__ import annotations

import os
import signal
import stat
import tempfile
from pathlib import Path

import pytest
import trio
import trio.testing

from vpool.protocol.framing import PREFIX
from vpool.protocol.messages import CkptPut
from vpool.worker_agent import criu
from vpool.worker_agent.ckpt_worker import (
    MAX_FRAME,
    Failed,
    FromWorker,
    LinkReader,
    Task,
    WorkerProtocolError,
    failure,
    frame,
)
from vpool.worker_agent.ckpt_workers import CkptWorkers, WorkerFailed
from vpool.worker_agent.store_client import StoreError


def task(tmp_path: Path, criu_path: str, *, stream_pages: bool = True) -> Task:
    scratch = Path(tempfile.mkdtemp(dir=tmp_path))  # one per checkpoint, as the agent makes
    (scratch / "images").mkdir()
    return Task(
        ckpt=7,
        clone=os.getpid(),  # never dumped: the stand-ins below do not dump
        enter=None,
        scratch=str(scratch),
        rank_dir=str(tmp_path),
        stream_pages=stream_pages,
        criu=criu_path,
        dump_timeout=60,
        key=bytes(32),
        job=1,
        rank=0,
        level=1,
        put=CkptPut(token="t", ckpt=7, received={}, dets=0, fingerprint="fp"),
        relay=None,
        tls=False,
        ca=None,
        agent_token="agent",
        max_payload=1 << 20,
        store_timeout=10,
    )


def hanging_criu(tmp_path: Path) -> tuple[Path, Path]:
    """A CRIU stand-in that writes its pid into a FIFO, then sleeps: a dump that never ends."""
    marker = tmp_path / "criu.pid"
    os.mkfifo(marker)
    script = tmp_path / "hanging-criu"
    script.write_text(f"#!/bin/sh\necho $$ > {marker}\nexec sleep 60\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, marker


async def wait_for(fifo: Path) -> int:
    """The pid the stand-in writes into ``fifo``, once it does."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # no writer yet: no hang-up either
    try:
        with trio.fail_after(20):
            await trio.lowlevel.wait_readable(fd)
        return int(os.read(fd, 64))
    finally:
        os.close(fd)


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


async def wait_gone(pid: int) -> None:
    """Wait until ``pid`` has exited (a SIGKILL lands a moment after ``kill`` returns): its
    pidfd turns readable then."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # exited and reaped already
    try:
        with trio.fail_after(10):
            await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)


def _dumped(seconds: float) -> None:
    raise AssertionError("nothing is dumped here")


async def _acked() -> None:
    raise AssertionError("nothing is stored here")


@pytest.mark.parametrize("stream_pages", [True, False], ids=["pipe", "file"])
@pytest.mark.large
async def test_a_worker_runs_niced_and_serves_one_task_after_another(
    tmp_path: Path, stream_pages: bool
) -> None:
    workers = CkptWorkers(nice=5)
    try:
        await workers.prewarm()  # as the agent does when it finds CRIU
        pids = set(workers.idle_pids)
        for _ in range(2):
            with pytest.raises(criu.CriuError, match="cannot run"):
                await workers.run(
                    task(tmp_path, str(tmp_path / "no-criu"), stream_pages=stream_pages),
                    dumped=_dumped,
                    acked=_acked,
                )
            [pid] = workers.idle_pids  # a failed task leaves the worker ready
            pids.add(pid)
        assert len(pids) == 1 and workers.started == 1
        # The whole process is niced (CRIU inherits it), the agent's thread is not.
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0) + 5
        assert os.getpgid(pid) == pid  # a process group of its own, for the kill
    finally:
        await workers.aclose()
    await wait_gone(pid)


@pytest.mark.large
async def test_a_cancelled_checkpoint_kills_the_worker_and_criu(tmp_path: Path) -> None:
    script, marker = hanging_criu(tmp_path)
    workers = CkptWorkers(nice=0)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                lambda: workers.run(task(tmp_path, str(script)), dumped=_dumped, acked=_acked)
            )
            criu_pid = await wait_for(marker)
            nursery.cancel_scope.cancel()
        await wait_gone(criu_pid)
        assert workers.idle_pids == []  # not kept: the next checkpoint starts a new one
        # The next one does.
        with pytest.raises(criu.CriuError):
            await workers.run(task(tmp_path, str(tmp_path / "none")), dumped=_dumped, acked=_acked)
        assert workers.started == 2
    finally:
        await workers.aclose()


@pytest.mark.large
async def test_a_worker_that_dies_fails_its_checkpoint_and_is_replaced(tmp_path: Path) -> None:
    script, marker = hanging_criu(tmp_path)
    workers = CkptWorkers(nice=0)
    criu_pids: list[int] = []

    async def kill_the_worker() -> None:
        criu_pids.append(await wait_for(marker))
        os.kill(parent_of(criu_pids[0]), signal.SIGKILL)  # the worker, which this test started

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(kill_the_worker)
            with pytest.raises(WorkerFailed, match="ended in the middle of a task"):
                await workers.run(task(tmp_path, str(script)), dumped=_dumped, acked=_acked)
        await wait_gone(criu_pids[0])  # its process group went with it
        assert workers.idle_pids == []
    finally:
        await workers.aclose()


@pytest.mark.large
async def test_store_failures_come_back_as_store_errors(tmp_path: Path) -> None:
    # A file dump that "succeeds" (the stand-in exits 0), then no relay to store at.
    ok = tmp_path / "true-criu"
    ok.write_text("#!/bin/sh\nexit 0\n")
    ok.chmod(0o755)
    dumps: list[float] = []
    workers = CkptWorkers(nice=0)
    try:
        with pytest.raises(StoreError, match="no home relay"):
            await workers.run(
                task(tmp_path, str(ok), stream_pages=False), dumped=dumps.append, acked=_acked
            )
        assert len(dumps) == 1  # told when the clone was dumped, before the store failed
    finally:
        await workers.aclose()


async def test_frames_too_long_or_cut_short_are_refused() -> None:
    send, receive = trio.testing.memory_stream_one_way_pair()
    reader = LinkReader(receive, FromWorker)
    await send.send_all(PREFIX.pack(MAX_FRAME + 1, 0))
    await trio.testing.wait_all_tasks_blocked()
    with pytest.raises(WorkerProtocolError, match="bytes"):
        await reader.next()
    send, receive = trio.testing.memory_stream_one_way_pair()
    reader = LinkReader(receive, FromWorker)
    await send.send_all(frame(Failed("other", "x"))[:-1])
    await send.aclose()
    with pytest.raises(WorkerProtocolError, match="middle of a frame"):
        await reader.next()
    send, receive = trio.testing.memory_stream_one_way_pair()
    reader = LinkReader(receive, FromWorker)
    await send.send_all(frame(Failed("other", "x")))
    await send.aclose()
    assert await reader.next() == Failed("other", "x")
    assert await reader.next() is None


def test_failures_keep_their_kind_and_code() -> None:
    assert failure(criu.CriuError("boom")) == Failed("criu", "boom")
    assert failure(StoreError("full", "storage_error")) == Failed("store", "full", "storage_error")
    group = BaseExceptionGroup("g", [StoreError("a", "fenced"), ValueError("b")])
    assert failure(group) == Failed("store", "a; b", "fenced")
