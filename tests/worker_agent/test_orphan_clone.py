"""A rank killed between its checkpoint fork and its ``CkptForked``: the orphaned clone says it
forked itself (``RankHello(orphan=True)``), and the agent still dumps it, by the pid the kernel
gives for the connection (SO_PEERCRED), never by the pid the clone claims."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import trio

from vpool.protocol.messages import (
    PROTOCOL_VERSION,
    CheckpointRequest,
    CkptForked,
    Error,
    RankHello,
    RankWelcome,
)
from vpool.worker_agent.checkpoints import Capability, Checkpointer
from vpool.worker_agent.local_ranks import LocalRank, LocalRanks
from vpool.worker_agent.output import OutputPump
from vpool.worker_agent.ranks import Prepared, RankServices
from vpool.worker_agent.settings import AgentSettings

from .test_checkpoints import _RANK, LEASE, _Client, _connect

# A clone that reports itself: hello as an orphan, its CkptForked (claiming the pid argv[3]),
# close, then live on (to be dumped, or killed) as the clone would.
_ORPHAN = """
import socket, sys, time
from vpool.protocol.framing import FrameDecoder, encode_frame
from vpool.protocol.messages import PROTOCOL_VERSION, CkptForked, RankHello
path, secret, ckpt, claimed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sock = socket.socket(socket.AF_UNIX)
sock.connect(path)
sock.sendall(encode_frame(RankHello(PROTOCOL_VERSION, secret, orphan=True)))
dec = FrameDecoder()
while (frame := dec.next_frame()) is None:
    dec.receive_data(sock.recv(65536))
print(type(frame.message).__name__, flush=True)
sock.sendall(encode_frame(CkptForked(ckpt, claimed, [0, 7], [3, 0], 2, [0, 0], 0)))
sock.close()
print("sent", flush=True)
time.sleep(60)
"""


def _popen(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", *args], stdout=subprocess.PIPE)


def _end(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.kill()
        p.wait()
        if p.stdout is not None:
            p.stdout.close()


async def _proxy(nursery: trio.Nursery, tmp_path: Path) -> tuple[LocalRanks, Path]:
    from vpool.worker_agent.proxy import RankProxy

    ranks = LocalRanks()
    path = await nursery.start(
        RankProxy(ranks, processor="host", max_payload=1 << 20).serve, tmp_path / "a.sock"
    )
    return ranks, path


async def test_orphan_report_is_handed_on_with_the_kernels_pid(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    ranks, path = await _proxy(nursery, tmp_path)
    rank = LocalRank(LEASE)
    ranks.add(rank)
    decoy = _popen(_RANK)
    procs = [decoy]
    try:
        assert decoy.stdout is not None and decoy.stdout.readline() == b"ready\n"
        clone = _popen(_ORPHAN, str(path), rank.secret, "41", str(decoy.pid))
        procs.append(clone)
        assert clone.stdout is not None
        assert await trio.to_thread.run_sync(clone.stdout.readline) == b"RankWelcome\n"
        assert await trio.to_thread.run_sync(clone.stdout.readline) == b"sent\n"
        with trio.fail_after(5):
            got = await rank.control_recv.receive()
        assert got == CkptForked(41, clone.pid, [0, 7], [3, 0], 2, [0, 0], 0, orphan=True)
        assert rank.control is None  # an orphan's connection is not the rank's control one
        # Anything but one CkptForked on it is refused and handed to nobody.
        conn, welcome = await _connect(path, RankHello(PROTOCOL_VERSION, rank.secret, orphan=True))
        assert isinstance(welcome, RankWelcome)
        await conn.send(CheckpointRequest(request=1))
        err = await conn.receive()
        assert isinstance(err, Error) and err.code == "unexpected_message"
        await conn.stream.aclose()
        assert decoy.poll() is None
    finally:
        _end(procs)
    with trio.move_on_after(0.2):
        await rank.control_recv.receive()
        raise AssertionError("a refused orphan report was handed on")


async def test_rank_killed_before_saying_it_forked_its_clone_is_still_dumped(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    ranks, path = await _proxy(nursery, tmp_path)
    rank = LocalRank(LEASE)
    ranks.add(rank)
    rank_proc, decoy = _popen(_RANK), _popen(_RANK)
    procs = [rank_proc, decoy]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        rank.pid = rank_proc.pid
        data, _ = await _connect(path, RankHello(PROTOCOL_VERSION, rank.secret))
        control, _ = await _connect(path, RankHello(PROTOCOL_VERSION, rank.secret, control=True))
        settings = AgentSettings(
            criu=str(tmp_path / "no-criu"),  # the dump fails: its error says it was tried
            checkpoint_scratch=str(tmp_path / "scratch"),
            work_dir=str(tmp_path / "w"),
            lost_checkpoint_grace=30,
        )
        client = _Client()
        svc = RankServices(
            settings=settings,
            client=client,  # type: ignore[arg-type]
            links=None,  # type: ignore[arg-type]
            blobs=None,  # type: ignore[arg-type]
            ranks=ranks,
            socket_path=path,
            report_problem=None,  # type: ignore[arg-type]
            capability=Capability(criu="4.1.1", fingerprint="fp"),
        )
        prepared = Prepared(tmp_path, tmp_path, tmp_path, tmp_path / "app.py", None, {})
        pump = OutputPump(LEASE, client.post_checkpoint_failed)  # type: ignore[arg-type]
        ckpt = Checkpointer(svc, rank, prepared, pump)
        result: list[bool] = []
        finished: list[bool] = []

        async def rank_dies_after_its_fork() -> None:
            req = await data.receive()
            assert isinstance(req, CheckpointRequest)
            # The rank forked and died before its own CkptForked: what ranks.execute sees.
            rank_proc.kill()
            await trio.to_thread.run_sync(rank_proc.wait)
            ckpt.closing = True
            lost = trio.Event()
            nursery.start_soon(finish, lost)
            clone = _popen(_ORPHAN, str(path), rank.secret, str(req.request), str(decoy.pid))
            procs.append(clone)
            assert clone.stdout is not None
            assert await trio.to_thread.run_sync(clone.stdout.readline) == b"RankWelcome\n"

        async def finish(lost: trio.Event) -> None:
            await ckpt.finish_in_flight(30, lost)
            finished.append(ckpt.taking is None)  # only once the checkpoint ended

        async with trio.open_nursery() as inner:
            inner.start_soon(ckpt._control_reader)
            inner.start_soon(rank_dies_after_its_fork)

            async def take() -> None:
                result.append(await ckpt.take(ordered=True))
                inner.cancel_scope.cancel()

            inner.start_soon(take)
        clone = procs[-1]
        assert result == [False]
        [failed] = client.failed
        assert "criu dump failed" in failed.message, failed  # the orphan was dumped
        assert ckpt.pauses == []  # the clone cannot know its rank's pause
        with trio.fail_after(5):
            while clone.poll() is None:  # noqa: ASYNC110
                await trio.sleep(0.01)
        assert clone.returncode == -signal.SIGKILL  # by the kernel's pid for it...
        assert decoy.poll() is None  # ...not by the one it claimed
        with trio.fail_after(5):
            while not finished:  # noqa: ASYNC110
                await trio.sleep(0.01)
        assert finished == [True]
        await data.stream.aclose()
        await control.stream.aclose()
    finally:
        _end(procs)
    assert not any((tmp_path / "scratch").iterdir())  # the scratch dir is gone
