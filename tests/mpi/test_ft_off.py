"""Fault tolerance off (``VPOOL_FT=0``, set by the coordinator for ``--no-fault-tolerance``
jobs): the runtime makes no determinant and never waits for a ``DetAck``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from tests.mpi.test_ft_unit import FakeEngine, FakeTransport, Op
from vpool.mpi.environment import fault_tolerant
from vpool.protocol.rank_ft import K_TEST, K_WTIME
from vpool.sdk import mpiexec

PROGRAM = Path(__file__).parent / "programs" / "ft_off.py"


class CountingRouter(mpiexec._Router):
    """The router of ``vsdk mpiexec``, counting the determinants each rank logged in its core
    (those it has when it exits)."""

    dets: dict[int, int] = {}

    def exited(self, rank: Any, code: int) -> None:
        box = self.core.boxes.get((mpiexec.JOB, rank.index))
        if box is not None and len(box.dets):
            CountingRouter.dets[rank.index] = len(box.dets)
        super().exited(rank, code)


async def _run(tmp_path: Path, monkeypatch: Any, env: dict[str, str]) -> tuple[int, str, str]:
    monkeypatch.setattr(mpiexec, "_Router", CountingRouter)
    CountingRouter.dets = {}
    out, err = tmp_path / "out", tmp_path / "err"
    with out.open("wb") as fo, err.open("wb") as fe, trio.fail_after(60):
        code = await mpiexec.run_async(3, [str(PROGRAM)], env=env, stdout=fo, stderr=fe)
    return code, out.read_text(), err.read_text()


@pytest.mark.large
async def test_no_det_frame_with_fault_tolerance_off(tmp_path: Path, monkeypatch: Any) -> None:
    code, out, err = await _run(tmp_path, monkeypatch, {"VPOOL_FT": "0"})
    assert code == 0, (out, err)
    assert CountingRouter.dets == {}
    # The runtime's own count agrees, and the program ran as with logging on.
    assert sorted(out.splitlines()) == [f"rank {r} sum 6 dets 0" for r in range(3)], err


@pytest.mark.large
async def test_the_same_program_logs_with_fault_tolerance_on(
    tmp_path: Path, monkeypatch: Any
) -> None:
    # The control: ANY_SOURCE, Wtime, Iprobe, Test and the Iallreduce rounds are determinants.
    monkeypatch.delenv("VPOOL_FT", raising=False)
    code, out, err = await _run(tmp_path, monkeypatch, {})
    assert code == 0, (out, err)
    assert sum(CountingRouter.dets.values()) > 0
    assert CountingRouter.dets.get(0, 0) > 0  # the ANY_SOURCE receiver
    counts = {int(line.split()[1]): int(line.split()[-1]) for line in out.splitlines()}
    assert counts == {r: CountingRouter.dets.get(r, 0) for r in range(3)}


@pytest.mark.parametrize(
    ("value", "on"), [(None, True), ("1", True), ("0", False), ("off", False), (" NO ", False)]
)
def test_vpool_ft_setting(monkeypatch: Any, value: str | None, on: bool) -> None:
    if value is None:
        monkeypatch.delenv("VPOOL_FT", raising=False)
    else:
        monkeypatch.setenv("VPOOL_FT", value)
    assert fault_tolerant() is on


def test_runtime_records_nothing_when_off(monkeypatch: Any) -> None:
    monkeypatch.setenv("VPOOL_FT", "0")
    eng = FakeEngine()
    t = FakeTransport()
    eng.ft.attach(t, 0, {}, logging=fault_tolerant())  # as MPI.Init does
    monkeypatch.setenv("VPOOL_FT", "1")  # read once, at attach (MPI.Init): no effect now
    ft = eng.ft
    op = Op()
    ft.any_post(op)
    ft.matched(op, 2)
    assert ft.decide(K_TEST, lambda: None) is None  # a failed test: not even a lazy record
    assert ft.decide(K_WTIME, lambda: 2.5) == 2.5

    class Sched:
        _sid = ft.new_schedule()

    t.sent[1] = 4
    assert ft.may_step(Sched())
    sent: list[tuple[int, int]] = []
    eng._send_notice = lambda src, seq: sent.append((src, seq))  # type: ignore[attr-defined]
    eng.notices.append((1, 3))
    ft.send_notices()
    assert sent == [(1, 3)]  # the notice still goes, unlogged
    assert t.det_need == t.det_acked  # every deposit takes the fast path
    ft.flush()
    assert t.written == [] and ft.pending == []
