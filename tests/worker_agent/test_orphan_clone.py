"""A rank killed between its checkpoint fork and its ``CkptForked``: the orphaned clone says it
forked itself (``RankHello(orphan=True)``), and the agent still dumps it, by the pid the kernel
gives for the connection (SO_PEERCRED), never by the pid the clone claims."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from vpool.protocol.messages import (
    PROTOCOL_VERSION,
    CheckpointRequest,
    CkptForked,
    Error,
    RankHello,
    RankWelcome,
)
from vpool.worker_agent.local_ranks import LocalRank, LocalRanks

from .test_checkpoint_failures import checkpointer, take_once
from .test_checkpoints import LEASE, _connect

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


# A rank, or a decoy, that sleeps (and ignores the checkpoint signal).
_RANK = (
    "import signal, time\n"
    "signal.signal(signal.SIGRTMIN + 4, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def _popen(*args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", *args], stdout=subprocess.PIPE)


def _end(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.kill()
        p.wait()
        if p.stdout is not None:
            p.stdout.close()


async def test_orphan_report_is_handed_on_with_the_kernels_pid(
    proxy: tuple[LocalRanks, Path],
) -> None:
    ranks, path = proxy
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
        # The proxy refuses before it would hand anything on: nothing is waiting.
        with pytest.raises(trio.WouldBlock):
            rank.control_recv.receive_nowait()
        assert decoy.poll() is None
    finally:
        _end(procs)


async def test_rank_killed_before_saying_it_forked_its_clone_is_still_dumped(
    nursery: trio.Nursery, proxy: tuple[LocalRanks, Path], tmp_path: Path
) -> None:
    ranks, path = proxy
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
        ckpt, client = checkpointer(ranks, path, rank, tmp_path, lost_checkpoint_grace=30)
        finished = trio.Event()
        ended_first: list[bool] = []

        async def finish(lost: trio.Event) -> None:
            await ckpt.finish_in_flight(30, lost)
            ended_first.append(ckpt.taking is None)  # only once the checkpoint ended
            finished.set()

        async def rank_dies_after_its_fork() -> None:
            req = await data.receive()
            assert isinstance(req, CheckpointRequest)
            # The rank forked and died before its own CkptForked: what ranks.execute sees.
            rank_proc.kill()
            await trio.to_thread.run_sync(rank_proc.wait)
            ckpt.close()
            nursery.start_soon(finish, trio.Event())
            clone = _popen(_ORPHAN, str(path), rank.secret, str(req.request), str(decoy.pid))
            procs.append(clone)
            assert clone.stdout is not None
            assert await trio.to_thread.run_sync(clone.stdout.readline) == b"RankWelcome\n"

        # The dump fails (no CRIU here): its error says the orphan was dumped.
        assert await take_once(ckpt, rank_dies_after_its_fork) is False
        clone = procs[-1]
        [failed] = client.failed
        assert "criu dump failed" in failed.message, failed  # the orphan was dumped
        assert ckpt.pauses == []  # the clone cannot know its rank's pause
        with trio.fail_after(5):
            await trio.to_thread.run_sync(clone.wait, abandon_on_cancel=True)
        assert clone.returncode == -signal.SIGKILL  # by the kernel's pid for it...
        assert decoy.poll() is None  # ...not by the one it claimed
        with trio.fail_after(5):
            await finished.wait()
        assert ended_first == [True]
        await data.stream.aclose()
        await control.stream.aclose()
    finally:
        _end(procs)
    assert not any((tmp_path / "scratch").iterdir())  # the scratch dir is gone
