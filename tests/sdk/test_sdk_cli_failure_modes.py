"""Failure modes in ``vsdk``: ``submit --on-failure`` and ``mpiexec --on-failure`` take every mode
of ``api.FAILURE_MODES`` (FT-MPI's "blank", "shrink" and "rebuild" as well as "ulfm"), refuse any
other with an error naming the choices, and the local router of ``vsdk mpiexec`` treats the
modes that report failures alike: a rank killed by a signal is declared failed and the job goes
on."""

from __future__ import annotations

import os
import signal
import types
from pathlib import Path
from typing import Any

import pytest
import trio
from click.testing import CliRunner

from vpool.protocol import api
from vpool.sdk import mpiexec
from vpool.sdk.cli import cli
from vpool.sdk.mpiexec_router import _Router

REPORTING = [mode for mode in api.FAILURE_MODES if mode in api.REPORTING_MODES]
CHOICES = "'transparent', 'abort', 'ulfm', 'blank', 'shrink', 'rebuild'"


def run(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, list(args))


def _flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture
def app(tmp_path: Path) -> Path:
    (tmp_path / "app.py").write_text("print('hi')\n")
    return tmp_path / "app.py"


def test_submit_sends_every_mode(coord: Any, app: Path) -> None:
    for number, mode in enumerate(api.FAILURE_MODES, start=1):
        res = run("submit", str(app), "-n", "2", "--on-failure", mode)
        assert res.exit_code == 0, res.stderr
        sub = coord.jobs[number].submit
        assert (sub.on_failure, sub.fault_tolerance) == (mode, mode == "transparent")
        said = {
            "transparent": "(2 ranks)",
            "abort": "(2 ranks, fault tolerance off)",
        }.get(mode, f"(2 ranks, failures reported to the program ({mode}))")
        assert f"job {number} submitted {said}" in res.stderr


def test_submit_refuses_an_unknown_mode_naming_the_choices(coord: Any, app: Path) -> None:
    for wrong in ("respawn", "Shrink", "ulfm,shrink", ""):
        res = run("submit", str(app), "-n", "2", "--on-failure", wrong)
        assert res.exit_code == 2, (wrong, res.output)
        assert f"Invalid value for '--on-failure': '{wrong}' is not one of {CHOICES}." in (
            _flat(res.stderr)
        )
        assert "Traceback" not in res.output
    # --no-fault-tolerance says "abort": with another mode it is a contradiction, said so.
    res = run("submit", str(app), "-n", "2", "--no-fault-tolerance", "--on-failure", "rebuild")
    assert res.exit_code == 2
    assert "--no-fault-tolerance is --on-failure abort, not rebuild" in res.stderr
    assert coord.jobs == {}


def test_help_names_every_mode() -> None:
    for command in ("submit", "mpiexec"):
        res = run(command, "--help")
        assert res.exit_code == 0, res.output
        text = _flat(res.output)
        assert f"--on-failure [{'|'.join(api.FAILURE_MODES)}]" in text, command
        assert "ulfm, blank, shrink" in text and "MPI.ERR_PROC_FAILED" in text
    assert "MPI.COMM_WORLD.Dup()" in _flat(run("submit", "--help").output)


def test_vsdk_mpiexec_passes_every_mode_and_refuses_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    fake = types.ModuleType("vpool.sdk.mpiexec")
    fake.run = lambda n, argv, stdin=None, on_failure="", universe=0: calls.append(on_failure)  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "vpool.sdk.mpiexec", fake)
    import vpool.sdk

    monkeypatch.setattr(vpool.sdk, "mpiexec", fake, raising=False)
    for mode in api.FAILURE_MODES:
        assert run("mpiexec", "-n", "2", "--on-failure", mode, "--", "app.py").exit_code == 0
    assert calls == list(api.FAILURE_MODES)
    res = run("mpiexec", "-n", "2", "--on-failure", "respawn", "--", "app.py")
    assert res.exit_code == 2
    assert f"'respawn' is not one of {CHOICES}" in _flat(res.stderr)
    assert len(calls) == len(api.FAILURE_MODES)


def test_python_m_mpiexec_takes_the_same_modes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(
        mpiexec, "run", lambda n, argv, on_failure, universe: calls.append(on_failure) or 0
    )
    for mode in api.FAILURE_MODES:
        assert mpiexec.main(["-n", "2", "--on-failure", mode, "app.py"]) == 0
    assert calls == list(api.FAILURE_MODES)
    with pytest.raises(SystemExit) as exc:
        mpiexec.main(["-n", "2", "--on-failure", "respawn", "app.py"])
    assert exc.value.code == 2
    assert "argument --on-failure: invalid choice: 'respawn'" in capsys.readouterr().err


def test_the_router_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="unknown failure mode 'respawn'"):
        _Router(2, 2, on_failure="respawn")


def _said(read_end: int) -> str:
    os.set_blocking(read_end, False)
    try:
        return os.read(read_end, 1 << 16).decode()
    except BlockingIOError:
        return ""


@pytest.mark.parametrize("mode", REPORTING)
async def test_a_killed_rank_is_declared_failed_and_the_survivors_decide(mode: str) -> None:
    read_end, write_end = os.pipe()
    try:
        router = _Router(3, write_end, on_failure=mode)
        killed = router.ranks[1]
        killed.exited = True
        router.exited(killed, -signal.SIGKILL)
        assert (router.failed, killed.failed, router.exit_code) == ([1], True, None)
        assert _said(read_end) == (
            "vsdk mpiexec: rank 1 was killed by signal SIGKILL: declared failed, the other "
            f"ranks go on (--on-failure {mode})\n"
        )
        for rank in (router.ranks[0], router.ranks[2]):
            rank.exited = True
            router.exited(rank, 0)
        assert router.all_exited.is_set() and router.exit_code is None  # the job's code: 0
    finally:
        os.close(read_end)
        os.close(write_end)


@pytest.mark.parametrize("mode", ["transparent", "abort"])
async def test_in_other_modes_a_killed_rank_ends_the_job(mode: str) -> None:
    read_end, write_end = os.pipe()
    try:
        router = _Router(3, write_end, on_failure=mode)
        async with trio.open_nursery() as nursery:
            router.nursery = nursery
            killed = router.ranks[1]
            killed.exited = True
            router.exited(killed, -signal.SIGKILL)
            nursery.cancel_scope.cancel()  # no processes to stop
        assert (router.failed, router.exit_code) == ([], 128 + signal.SIGKILL)
        assert _said(read_end) == (
            "vsdk mpiexec: rank 1 was killed by signal SIGKILL: the job ends "
            f"(--on-failure {mode})\n"
        )
    finally:
        os.close(read_end)
        os.close(write_end)
