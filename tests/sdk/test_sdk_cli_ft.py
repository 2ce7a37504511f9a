"""``vsdk submit --no-fault-tolerance``: documented, sent as ``JobSubmit.fault_tolerance``,
shown by ``vsdk status``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
from click.testing import CliRunner

from vpool.sdk.cli import cli


def run(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, list(args))


def test_help_documents_the_switch() -> None:
    res = run("submit", "--help")
    assert res.exit_code == 0, res.output
    assert "--fault-tolerance / --no-fault-tolerance" in res.output
    assert "fails the job" in " ".join(res.output.split())


def test_submit_sends_the_switch(coord: Any, tmp_path: Path) -> None:
    app = tmp_path / "app.py"
    app.write_text("print('hi')\n")
    res = run("submit", str(app), "-n", "2")
    assert res.exit_code == 0, res.stderr
    res = run("submit", str(app), "-n", "2", "--no-fault-tolerance", "--", "--x", "1")
    assert res.exit_code == 0, res.stderr
    assert res.stdout == "2\n"
    assert "(2 ranks, fault tolerance off)" in res.stderr
    assert coord.jobs[1].submit.fault_tolerance is True
    assert coord.jobs[2].submit.fault_tolerance is False
    assert coord.jobs[2].submit.args == ["--x", "1"]  # the flag is vsdk's, not the program's


def test_status_shows_the_switch(coord: Any, tmp_path: Path) -> None:
    app = tmp_path / "app.py"
    app.write_text("print('hi')\n")
    assert run("submit", str(app), "-n", "2").exit_code == 0
    assert "fault tolerance" not in run("status", "1").stdout
    job = coord.jobs[1]
    job.info = msgspec.structs.replace(job.info, fault_tolerance=False)
    res = run("status", "1")
    assert res.exit_code == 0, res.output
    assert (
        res.stdout.splitlines()[0] == "job 1  'app.py'  user alice  2 ranks  (fault tolerance off)"
    )


def test_client_passes_the_switch(coord: Any, tmp_path: Path) -> None:
    app = tmp_path / "app.py"
    app.write_text("print('hi')\n")
    with coord.client() as client:
        client.submit(app, 1, fault_tolerance=False)
    assert coord.jobs[1].submit.fault_tolerance is False
