"""``vsdk submit --checkpoint-every`` and ``vsdk checkpoint JOB [--rank R]``: documented, sent
as ``JobSubmit.checkpoint_every`` and ``CheckpointAsk``, errors shown as the API's message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from click.testing import CliRunner

from vpool.protocol.api import CheckpointAsk, CheckpointAsked
from vpool.sdk.cli import cli


def run(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, list(args))


@pytest.fixture
def ckpt_coord(coord: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The fake coordinator of ``coord`` plus ``POST /jobs/{id}/checkpoint``: every rank of a
    running job is asked, a finished job is a 409."""
    fake_type = type(coord)
    asks: list[tuple[int, CheckpointAsk]] = []

    class CheckpointingCoordinator(fake_type):  # type: ignore[misc, valid-type]
        def _routes(self):  # type: ignore[no-untyped-def]
            return [
                (r"/api/v1/jobs/(\d+)/checkpoint", "POST", self._checkpoint),
                *super()._routes(),
            ]

        def _checkpoint(self, request: httpx.Request, job_id: str) -> httpx.Response:
            job = self._job(job_id)
            if job is None:
                return self._error(404, "unknown_job", f"no job {job_id}")
            ask = msgspec.json.decode(request.read(), type=CheckpointAsk)
            asks.append((int(job_id), ask))
            if job.info.state != "running":
                return self._error(
                    409,
                    "job_not_running",
                    f"job {job_id} is {job.info.state}: only a running job can be checkpointed",
                )
            ranks = list(range(job.info.ranks)) if ask.rank is None else [ask.rank]
            return self._json(CheckpointAsked(job=int(job_id), ranks=ranks), 202)

    fake = CheckpointingCoordinator()
    fake.asks = asks
    from vpool.sdk.cli_common import Settings

    monkeypatch.setattr(Settings, "client", lambda self: fake.client())
    return fake


def _app(tmp_path: Path) -> Path:
    app = tmp_path / "app.py"
    app.write_text("print('hi')\n")
    return app


def test_help_documents_the_options() -> None:
    res = run("submit", "--help")
    assert res.exit_code == 0, res.output
    assert "--checkpoint-every SECONDS" in res.output
    res = run("checkpoint", "--help")
    assert res.exit_code == 0, res.output
    assert "vsdk checkpoint 12 --rank 3" in res.output


def test_submit_sends_the_period(ckpt_coord: Any, tmp_path: Path) -> None:
    app = _app(tmp_path)
    assert run("submit", str(app), "-n", "2").exit_code == 0
    res = run("submit", str(app), "-n", "2", "--checkpoint-every", "600")
    assert res.exit_code == 0, res.stderr
    assert "(2 ranks, a checkpoint every 600 s)" in res.stderr
    assert ckpt_coord.jobs[1].submit.checkpoint_every == 0.0
    assert ckpt_coord.jobs[2].submit.checkpoint_every == 600.0
    with ckpt_coord.client() as client:
        client.submit(app, 1, checkpoint_every=30)
    assert ckpt_coord.jobs[3].submit.checkpoint_every == 30.0


def test_submit_refuses_checkpoints_without_fault_tolerance(
    ckpt_coord: Any, tmp_path: Path
) -> None:
    app = _app(tmp_path)
    res = run("submit", str(app), "-n", "2", "--checkpoint-every", "60", "--no-fault-tolerance")
    assert res.exit_code == 2
    assert "--checkpoint-every needs fault tolerance" in res.stderr
    res = run("submit", str(app), "-n", "2", "--checkpoint-every", "-1")
    assert res.exit_code == 2
    assert ckpt_coord.jobs == {}


def test_checkpoint_asks_and_says_which_ranks(ckpt_coord: Any, tmp_path: Path) -> None:
    assert run("submit", str(_app(tmp_path)), "-n", "3").exit_code == 0
    job = ckpt_coord.jobs[1]
    job.info = msgspec.structs.replace(job.info, state="running")
    res = run("checkpoint", "1")
    assert res.exit_code == 0, res.output
    assert res.stdout == "job 1: asked ranks 0, 1, 2 to checkpoint\n"
    res = run("checkpoint", "1", "--rank", "2")
    assert res.stdout == "job 1: asked rank 2 to checkpoint\n"
    res = run("checkpoint", "1", "--json")
    assert msgspec.json.decode(res.stdout) == {"job": 1, "ranks": [0, 1, 2]}
    assert [(j, a.rank) for j, a in ckpt_coord.asks] == [(1, None), (1, 2), (1, None)]


def test_checkpoint_errors_exit_1_with_the_message(ckpt_coord: Any, tmp_path: Path) -> None:
    assert run("submit", str(_app(tmp_path)), "-n", "2").exit_code == 0
    res = run("checkpoint", "1")  # still queued in the fake
    assert res.exit_code == 1
    assert "job 1 is queued: only a running job can be checkpointed" in res.stderr
    assert "job_not_running" in res.stderr
    res = run("checkpoint", "7")
    assert res.exit_code == 1 and "no job 7" in res.stderr
