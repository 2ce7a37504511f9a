"""Intercommunicators: end to end with real rank processes through ``vpool.sdk.mpiexec``
(``programs/intercomm_conformance.py`` says what it checks on every rank), killed ranks
replaying it, and in process the handles and the envelopes of their messages (a fake engine
that records what would be sent and posted)."""

from __future__ import annotations

import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

import pytest
import trio

from vpool.mpi import errors, intercomm
from vpool.mpi.comm import Intercomm, Intracomm, _class_of, _Core
from vpool.mpi.constants import ANY_SOURCE, CONGRUENT, PROC_NULL, ROOT, SIMILAR, UNDEFINED, UNEQUAL
from vpool.mpi.intercoll import check_root
from vpool.mpi.request import RecvOp

PROGRAM = Path(__file__).resolve().parent / "programs" / "intercomm_conformance.py"


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.large
async def test_intercomm_conformance(n: int) -> None:
    cmd = [sys.executable, "-m", "vpool.sdk.mpiexec", "-n", str(n), "--", str(PROGRAM)]
    with trio.fail_after(120):
        proc = await trio.run_process(
            cmd, stdin=subprocess.DEVNULL, capture_stdout=True, capture_stderr=True, check=False
        )
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    assert out == f"intercomm ok {n}\n", f"{out}\n{err}"


@pytest.mark.parametrize(("n", "kill"), [(3, "0:40"), (4, "1:200"), (4, "3:350")])
@pytest.mark.large
async def test_killed_rank_replays_intercomms(n: int, kill: str) -> None:
    # Intercommunicator construction, collectives and ANY_SOURCE traffic replay as they ran.
    from tests.mpi.test_ft_replay import bench

    res = await bench(n, "intercomm_conformance.py", kill=kill, deadline=90)
    assert res.returncode == 0, res
    assert res.stdout == f"intercomm ok {n}\n", res
    assert f"restarting rank {kill.split(':')[0]} (incarnation 2) with replay" in res.stderr, res
    assert "not deterministic" not in res.stderr, res


# ---- in process ----------------------------------------------------------------------------


class FakeEngine:
    """Rank ``rank`` of ``size``: records sends and posted receives; nothing ever arrives."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.next_ctx = 4
        self.ft = None
        self.broken = False  # no failure known (ULFM): no entry checks
        self.schedules: list[Any] = []
        self.sent: list[tuple[int, int, int, bytes]] = []
        self.posted: list[RecvOp] = []

    def send(
        self, dst: int, ctx: int, tag: int, kind: int, parts: list[int], bufs: list[Any], n: int
    ) -> None:
        self.sent.append((dst, ctx, tag, b"".join(bytes(b) for b in bufs)))

    def post(self, op: RecvOp) -> None:
        self.posted.append(op)


def inter(rank: int = 0, group: tuple[int, ...] = (0, 1), remote: tuple[int, ...] = (2, 3)) -> Any:
    eng = FakeEngine(rank, 5)
    return Intercomm._wrap(_Core(eng, 8, group, remote=remote)), eng


def test_an_intercommunicator_core_names_the_remote_group_for_point_to_point() -> None:
    comm, eng = inter(rank=1, group=(1, 4), remote=(3, 0, 2))
    h = comm._core()
    assert (h.rank, h.size, h.group) == (0, 2, (1, 4))
    assert (h.peers, h.psize) == ((3, 0, 2), 3)
    assert [h.pw2c[w] for w in range(5)] == [1, UNDEFINED, 2, 0, UNDEFINED]
    assert h.w2c[4] == 1 and h.w2c[3] == UNDEFINED
    local = h.local
    assert (local.ctx, local.group, local.remote, local.local) == (10, (1, 4), None, None)
    assert local.peers is local.group and local.pw2c is local.w2c
    assert (comm.Get_rank(), comm.Get_size(), comm.Get_remote_size()) == (0, 2, 3)
    assert comm.Get_remote_group()._m() == (3, 0, 2)
    assert comm.Is_inter() and not comm.Is_intra()
    comm.send("x", dest=2, tag=4)
    comm.Send(array("i", [7]), dest=0, tag=5)
    assert [s[:3] for s in eng.sent] == [(2, 8, 4), (3, 8, 5)]
    comm.irecv(source=1)
    assert (eng.posted[-1].ctx, eng.posted[-1].src) == (8, 0)
    assert eng.posted[-1].w2c is h.pw2c
    with pytest.raises(errors.MPIException) as info:
        comm.send("x", dest=3)
    assert info.value.Get_error_class() == errors.ERR_RANK


def test_kinds_of_handles_are_told_apart() -> None:
    comm, eng = inter()
    intra = Intracomm._wrap(_Core(eng, 4, (0, 1)))
    with pytest.raises(TypeError):
        Intracomm(comm)
    with pytest.raises(TypeError):
        Intercomm(intra)
    assert _class_of(comm._core()) is Intercomm and _class_of(intra._core()) is Intracomm
    assert Intercomm(Intercomm()) == Intercomm() and not Intercomm()
    same = Intercomm._wrap(_Core(eng, 12, (0, 1), remote=(2, 3)))
    shuffled = Intercomm._wrap(_Core(eng, 16, (1, 0), remote=(3, 2)))
    other = Intercomm._wrap(_Core(eng, 20, (0, 1), remote=(2, 4)))
    assert comm.Compare(same) == CONGRUENT
    assert comm.Compare(shuffled) == SIMILAR
    assert comm.Compare(other) == UNEQUAL
    assert comm.Compare(intra) == UNEQUAL


def test_roots_follow_mpis_convention() -> None:
    comm, _ = inter()
    h = comm._core()
    assert [check_root(h, r) for r in (ROOT, PROC_NULL, 0, 1)] == [ROOT, PROC_NULL, 0, 1]
    for bad in (ANY_SOURCE, 2, -7):
        with pytest.raises(errors.MPIException) as info:
            check_root(h, bad)
        assert info.value.Get_error_class() == errors.ERR_ROOT


def test_collectives_use_the_collective_contexts_and_their_own_sequences() -> None:
    # Rank 0 leads the local group (0, 1) facing (2, 3); context 8: p2p 8, between the groups
    # 9, the local core 10/11. Every call takes the next number of both sequences.
    comm, eng = inter()
    comm.Ibcast(array("i", [1, 2]), root=ROOT)
    assert eng.sent == [(2, 9, 1, array("i", [1, 2]).tobytes())]
    eng.sent.clear()
    comm.Ibcast(array("i", [0, 0]), root=PROC_NULL)
    assert eng.sent == [] and eng.posted == []
    comm.Ibarrier()
    assert eng.sent == [(1, 11, 3, b"")]  # the local barrier's first round
    assert [(op.ctx, op.src, op.tag) for op in eng.posted] == [(11, 1, 3)]
    eng.sent.clear()
    eng.posted.clear()
    comm.Iallreduce(array("i", [5]), array("i", [0]))  # reduce to the leader: waits for rank 1
    assert eng.sent == [] and [(op.ctx, op.src, op.tag) for op in eng.posted] == [(11, 1, 4)]
    eng.posted.clear()
    comm.Ialltoall(array("i", [6, 7]), array("i", [0, 0]))  # straight to every remote rank
    assert sorted(eng.sent) == [
        (2, 9, 5, array("i", [6]).tobytes()),
        (3, 9, 5, array("i", [7]).tobytes()),
    ]
    assert sorted((op.ctx, op.src, op.tag) for op in eng.posted) == [(9, 2, 5), (9, 3, 5)]


def test_collectives_name_every_source() -> None:
    # No ANY_SOURCE receive anywhere: nothing for the runtime to log or replay.
    for rank, group, remote in ((0, (0, 1), (2, 3, 4)), (3, (2, 3, 4), (0, 1))):
        comm, eng = inter(rank, group, remote)
        rsize = len(remote)
        ints = array("i", [0] * rsize)
        for root in (ROOT, PROC_NULL, 0):
            comm.Ibcast(array("i", [1]), root=root)
            comm.Igather(array("i", [1]), ints, root=root)
            comm.Iscatter(ints, array("i", [1]), root=root)
            comm.Ireduce(array("i", [1]), array("i", [1]), root=root)
        comm.Ibarrier()
        comm.Iallgather(array("i", [1]), ints)
        comm.Iallgatherv(array("i", [1]), ints)
        comm.Ialltoallv(ints, ints)
        comm.Ireduce_scatter_block(array("i", [0] * len(group)), array("i", [0]))
        assert eng.posted and all(op.src >= 0 for op in eng.posted)


def test_both_groups_order_alike() -> None:
    assert intercomm.union((4, 1), (0, 3)) == (0, 3, 4, 1)
    assert intercomm.union((0, 3), (4, 1)) == (0, 3, 4, 1)
    with pytest.raises(errors.MPIException):
        intercomm.union((0, 1), (1, 2))
    low, _ = inter(rank=1, group=(0, 1), remote=(2, 3))
    high, _ = inter(rank=3, group=(2, 3), remote=(0, 1))
    names = (["a0", "a1"], ["b2", "b3"])
    assert intercomm.both_in_order(low._core(), *names) == (["a0", "a1", "b2", "b3"], 1)
    names = (["b2", "b3"], ["a0", "a1"])
    assert intercomm.both_in_order(high._core(), *names) == (["a0", "a1", "b2", "b3"], 3)
