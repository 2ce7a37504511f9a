"""A checkpoint that fails at the dump, with no CRIU and no relay: the clone is killed and the
coordinator told, unless the failure came from the rank's own end."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from vpool.protocol import api
from vpool.protocol.messages import PROTOCOL_VERSION, CheckpointRequest, CkptForked, RankHello
from vpool.worker_agent import checkpoints
from vpool.worker_agent.checkpoints import Capability, Checkpointer
from vpool.worker_agent.local_ranks import LocalRank, LocalRanks
from vpool.worker_agent.output import OutputPump
from vpool.worker_agent.ranks import Prepared, RankServices
from vpool.worker_agent.settings import AgentSettings

from .test_checkpoints import LEASE, FakeRankConn, _connect

# A rank and its clone: a child of its own (the agent kills only a process of the rank's).
_RANK = (
    "import os, signal, sys, time\n"
    "signal.signal(signal.SIGRTMIN + 4, signal.SIG_IGN)\n"
    "clone = os.fork()\n"
    "if clone == 0:\n    time.sleep(60)\n    os._exit(0)\n"
    "print('ready', clone, flush=True)\n"
    "time.sleep(60)\n"
)


class _Client:
    def __init__(self) -> None:
        self.failed: list[api.CheckpointFailed] = []
        self.token = "agent"

    async def post_checkpoint_failed(self, report: api.CheckpointFailed) -> None:
        self.failed.append(report)


def checkpointer(
    ranks: LocalRanks, path: Path, rank: LocalRank, tmp_path: Path, **settings: Any
) -> tuple[Checkpointer, _Client]:
    """A Checkpointer of ``rank`` behind the proxy at ``path``, with no usable CRIU (its dumps
    fail, which the failure report says), and the fake coordinator client it reports to."""
    client = _Client()
    defaults = {
        "criu": str(tmp_path / "no-criu"),
        "checkpoint_scratch": str(tmp_path / "scratch"),
        "work_dir": str(tmp_path / "w"),
    }
    svc = RankServices(
        settings=AgentSettings(**(defaults | settings)),
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
    return Checkpointer(svc, rank, prepared, pump), client


async def take_once(
    ckpt: Checkpointer, rank_side: Callable[[], Awaitable[None]], *, ordered: bool = True
) -> bool:
    """``ckpt.take(ordered=...)`` with its control reader and ``rank_side`` running beside it."""
    result: list[bool] = []
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ckpt._control_reader)
            nursery.start_soon(rank_side)

            async def take() -> None:
                result.append(await ckpt.take(ordered=ordered))
                nursery.cancel_scope.cancel()

            nursery.start_soon(take)
    finally:
        await ckpt.svc.aclose()  # the checkpoint worker
    return result[0]


@dataclass
class Dumping:
    """A rank (a sleeping process) connected to the proxy, a clone of it (its child), and the
    rank's Checkpointer, whose dumps fail."""

    rank_proc: subprocess.Popen[bytes]
    clone: int  # the rank's child, not reaped (a zombie once killed)
    data: FakeRankConn
    control: FakeRankConn
    ckpt: Checkpointer
    client: _Client

    async def forked(self) -> None:
        """The rank's side of a checkpoint: the request arrives on the data connection, the
        clone's pid goes back on control (with a pause of 1.5 ms, as the rank measured it)."""
        req = await self.data.receive()
        assert isinstance(req, CheckpointRequest)
        forked = CkptForked(req.request, self.clone, [0, 0], [0, 0], 0, [0, 0], 1500)
        await self.control.send(forked)


@contextlib.asynccontextmanager
async def dumping(
    proxy: tuple[LocalRanks, Path], tmp_path: Path, **settings: Any
) -> AsyncIterator[Dumping]:
    ranks, path = proxy
    rank = LocalRank(LEASE)
    ranks.add(rank)
    procs = [subprocess.Popen([sys.executable, "-c", _RANK], stdout=subprocess.PIPE)]  # noqa: ASYNC220
    try:
        [rank_proc] = procs
        assert rank_proc.stdout is not None
        word, clone_text = rank_proc.stdout.readline().split()
        assert word == b"ready"
        clone = int(clone_text)
        rank.pid = rank_proc.pid
        data, _ = await _connect(path, RankHello(PROTOCOL_VERSION, rank.secret))
        control, _ = await _connect(path, RankHello(PROTOCOL_VERSION, rank.secret, control=True))
        ckpt, client = checkpointer(ranks, path, rank, tmp_path, **settings)
        try:
            yield Dumping(rank_proc, clone, data, control, ckpt, client)
        finally:
            await data.stream.aclose()
            await control.stream.aclose()
    finally:
        for p in procs:
            p.kill()
            p.wait()
            if p.stdout is not None:
                p.stdout.close()


async def test_failed_dump_kills_the_clone_and_is_reported(
    proxy: tuple[LocalRanks, Path], tmp_path: Path
) -> None:
    async with dumping(proxy, tmp_path) as d:
        assert await take_once(d.ckpt, d.forked) is False
        [failed] = d.client.failed
        assert (failed.job, failed.rank, failed.incarnation) == (3, 1, 2)
        assert failed.ckpt > 0 and "criu" in failed.message
        assert d.ckpt.pauses == [0.0015]  # as the rank measured it
        fd = os.pidfd_open(d.clone)
        try:
            with trio.fail_after(5):
                await trio.lowlevel.wait_readable(fd)
        finally:
            os.close(fd)
        # Its exit status, as its parent would reap it (/proc/PID/stat's last field).
        with open(f"/proc/{d.clone}/stat") as f:  # noqa: ASYNC230 - procfs
            assert int(f.read().rsplit(maxsplit=1)[1]) == signal.SIGKILL
        assert d.rank_proc.poll() is None  # the rank runs on
        assert not any((tmp_path / "scratch").iterdir())  # the scratch dir is gone


@pytest.mark.parametrize("rank_ends", [False, True], ids=["rank-runs", "rank-ended"])
async def test_periodic_checkpoint_lost_with_its_ending_rank_is_not_a_failure(
    proxy: tuple[LocalRanks, Path], tmp_path: Path, rank_ends: bool
) -> None:
    """A restored rank's clone lives in the rank's PID namespace: a rank that exits while its
    periodic checkpoint is dumped takes the dump with it. That is the job ending, not a failure
    to report; the same failure of a rank that runs on is reported."""
    async with dumping(proxy, tmp_path) as d:

        async def fake_rank() -> None:
            await d.forked()
            if rank_ends:
                d.ckpt.close()  # as ranks.execute does once the process ended

        assert await take_once(d.ckpt, fake_rank, ordered=False) is False
        if rank_ends:
            assert d.client.failed == []
        else:
            [failed] = d.client.failed
            assert "criu" in failed.message


def test_a_clone_holding_a_unix_socket_is_waited_for() -> None:
    """CRIU refuses a clone that still holds its connection to the agent ("External socket
    is used"): the agent waits for the clone to let go first (it does right after the fork,
    but an idle-class process on a busy machine may not have run yet)."""
    a, b = socket.socketpair()
    try:
        assert checkpoints._holds_unix_socket(os.getpid())
    finally:
        a.close()
        b.close()
    assert not checkpoints._holds_unix_socket(2**22 + 1)  # no such process: nothing to wait for


# A criu that refuses every dump as CRIU refuses a process holding a unix socket whose peer is
# outside the dump (or, with "other", for another reason), and counts its runs.
_REFUSING_CRIU = """#!/bin/sh
echo run >> {runs}
while [ $# -gt 0 ]; do
    if [ "$1" = -o ]; then log=$2; fi
    shift
done
echo "Error (criu/sk-unix.c:874): unix: {why}" > "$log"
exit 1
"""


@pytest.mark.parametrize(
    ("why", "runs"),
    [("External socket is used. Consider using --ext-unix-sk option.", 3), ("other", 1)],
    ids=["socket", "other"],
)
async def test_a_dump_refused_for_a_socket_is_tried_again(
    proxy: tuple[LocalRanks, Path], tmp_path: Path, why: str, runs: int
) -> None:
    """An orphaned clone connects to the agent when its rank dies (``RankHello.orphan``), which
    may be after the agent saw it hold no socket and before CRIU seized it: CRIU refuses it then
    ("External socket is used"), before writing any page. The agent dumps it again (at most
    ``DUMP_TRIES`` times); any other refusal is final at once."""
    fake = tmp_path / "criu"
    fake.write_text(_REFUSING_CRIU.format(runs=tmp_path / "runs", why=why))
    fake.chmod(0o755)
    async with dumping(proxy, tmp_path, criu=str(fake)) as d:
        assert await take_once(d.ckpt, d.forked) is False
        assert (tmp_path / "runs").read_text().split() == ["run"] * runs
        [failed] = d.client.failed
        assert why.split(".")[0] in failed.message, failed.message
        assert not any((tmp_path / "scratch").iterdir())
