"""Checkpoints of the rank runtime (``vpool.mpi.checkpoint``) through the replay bench's
``--ckpt`` (``tests/mpi/bench/replay.py``), without CRIU: the forked clone of a rank is
"restored" by killing the rank, which reparents the clone, and it must carry the job on to the
same output as an uncheckpointed run."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import trio

from tests.mpi.test_ft_replay import CASES, bench
from tests.mpi.test_mpi import Result, mpiexec

# (rank, messages before the request, messages after the commit before the kill). Only the
# farm's master: a worker may get no task beyond its prefetched ones (the others took them all)
# and then finish before the kill, which would make the case depend on scheduling.
POINTS = {
    "farm.py": ["0:1:0", "0:30:40"],
    "ft_poll.py": ["0:10:20", "2:5:10"],
    "ft_halo.py": ["0:30:20", "3:50:50"],
    "ft_nbc.py": ["0:10:20", "1:40:10"],
    "ft_issend.py": ["0:10:20", "2:30:20"],
}


def _records(res: Result) -> list[dict[str, object]]:
    """The counters the router noted at each CkptForked."""
    found = re.findall(r"checkpoint 1 of rank \d+: (\{.*\})", res.stderr)
    return [json.loads(text) for text in found]


def _clone(res: Result) -> int:
    match = re.search(r"checkpoint 1 of rank \d+: clone (\d+)", res.stderr)
    assert match, res
    return int(match.group(1))


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


async def _ended(pid: int, deadline: float) -> None:
    """Wait until process ``pid`` (not our child) has ended."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        with trio.fail_after(deadline):
            await trio.lowlevel.wait_readable(pidfd)
    finally:
        os.close(pidfd)


@pytest.mark.parametrize(
    ("program", "n", "expected", "spec"),
    [(p, n, e, s) for p, n, e, _ in CASES for s in POINTS[p]],
)
@pytest.mark.large
async def test_restored_rank_carries_on(program: str, n: int, expected: str, spec: str) -> None:
    res = await bench(n, program, ckpt=spec, deadline=90)
    assert res.returncode == 0, res
    assert res.stdout == expected, res
    rank = spec.split(":")[0]
    assert f"restored rank {rank} from checkpoint 1" in res.stderr, res
    assert "not deterministic" not in res.stderr, res
    assert _gone(_clone(res))


@pytest.mark.large
async def test_checkpoint_of_a_computing_rank_goes_through_the_signal() -> None:
    # Rank 1 deposits 5 messages, then loops without MPI calls: the request comes while it
    # computes, and only the signal handler can take it there (its counters say so: nothing
    # sent after the fifth message). Restored in the middle of the loop, it ends it the same.
    plain = await mpiexec(2, "ckpt_compute.py")
    assert plain.returncode == 0, plain
    res = await bench(2, "ckpt_compute.py", ckpt="1:5:3", deadline=90)
    assert res.returncode == 0, res
    assert res.stdout == plain.stdout, res
    [record] = _records(res)
    assert record["sent"] == [5, 0], res
    assert record["incarnation"] == 1, res
    assert "restored rank 1 from checkpoint 1" in res.stderr, res


@pytest.mark.large
async def test_request_while_replaying_is_deferred() -> None:
    # Rank 0 is killed after 100 messages and replays; the request comes at the 20th message
    # of its replay and is taken only once the replay is over: every logged determinant
    # obeyed, every message the relays held re-sent.
    res = await bench(4, "farm.py", kill="0:100", ckpt="0:20:10", deadline=90)
    assert res.returncode == 0, res
    assert res.stdout == "farm ok 300\n", res
    [record] = _records(res)
    assert record["incarnation"] == 2, res
    welcome_sent = {int(d): seq for d, seq in record["welcome_sent"].items()}  # type: ignore[attr-defined]
    assert welcome_sent, res
    assert record["dets"] >= record["welcome_dets"] > 0, res  # type: ignore[operator]
    sent = record["sent"]
    assert all(sent[d] >= seq for d, seq in welcome_sent.items()), res  # type: ignore[index]
    assert "restored rank 0 from checkpoint 1" in res.stderr, res
    assert "restoring rank 0 (incarnation 3)" in res.stderr, res


@pytest.mark.large
async def test_orphaned_clone_exits_by_itself() -> None:
    # The rank is killed without a restore file: its clone, reparented, must exit on its own
    # (the router waits for that), and the rank restarts from the beginning. The farm's master:
    # it deposits every task (a worker may get too few to reach the kill).
    res = await bench(4, "farm.py", ckpt="0:20:10:orphan", deadline=90)
    assert res.returncode == 0, res
    assert res.stdout == "farm ok 300\n", res
    pid = _clone(res)
    assert f"orphaned clone {pid} of rank 0 exited" in res.stderr, res
    assert "restarting rank 0 (incarnation 2) with replay" in res.stderr, res
    await _ended(pid, 10)


@pytest.mark.large
async def test_clone_of_a_finished_rank_exits() -> None:
    # The kill never comes (the rank ends first): the clone is orphaned when its rank exits.
    res = await bench(2, "ckpt_compute.py", ckpt="1:5:1000")
    assert res.returncode == 0, res
    assert "restored" not in res.stderr, res
    pid = _clone(res)
    await _ended(pid, 10)


@pytest.mark.large
async def test_bad_ckpt_spec_is_refused() -> None:
    res = await bench(2, "ckpt_compute.py", ckpt="1:5")
    assert res.returncode != 0
    assert "expected RANK:N:M[:orphan]" in res.stderr, res


def test_checkpoints_are_off_without_the_agent_settings() -> None:
    from vpool.mpi import checkpoint

    saved = {k: os.environ.pop(k, None) for k in (checkpoint.SIGNAL_ENV, checkpoint.RANK_DIR_ENV)}
    try:
        assert checkpoint.start(None, None, "") is None
    finally:
        os.environ.update({k: v for k, v in saved.items() if v is not None})


@pytest.mark.medium
def test_orphaned_clone_reports_its_own_fork(tmp_path: Path) -> None:
    # The rank died before its CkptForked: the clone says it, as itself, on a connection of its
    # own, then closes it (CRIU will not dump a socket to the agent).
    import socket
    import threading
    from types import SimpleNamespace

    from vpool.mpi import checkpoint
    from vpool.protocol.framing import FrameDecoder, encode_frame
    from vpool.protocol.messages import CkptForked, RankHello, RankWelcome

    path = str(tmp_path / "agent.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)
    got: list[object] = []

    def agent() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(10)
            dec = FrameDecoder()
            while True:
                data = conn.recv(65536)
                dec.receive_data(data)
                while (frame := dec.next_frame()) is not None:
                    got.append(frame.message)
                    if isinstance(frame.message, RankHello):
                        welcome = RankWelcome(job=1, rank=0, size=2, incarnation=1)
                        conn.sendall(encode_frame(welcome))
                if not data:
                    return  # the clone closed it

    thread = threading.Thread(target=agent, daemon=True)
    thread.start()
    fake = SimpleNamespace(path=path, secret="s3cret")
    forked = CkptForked(9, 0, [0, 4], [2, 0], 3, [5, 1])
    checkpoint.Checkpointer._report_orphan(fake, forked)  # type: ignore[arg-type]
    thread.join(10)
    server.close()
    assert not thread.is_alive()
    hello, report = got
    assert isinstance(hello, RankHello) and hello.orphan and hello.secret == "s3cret"
    assert report == CkptForked(9, os.getpid(), [0, 4], [2, 0], 3, [5, 1], orphan=True)
