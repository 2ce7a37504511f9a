"""Validation by replay on a real local pool (issue 20): jobs submitted with --validate have
their ranks re-executed from their logs on other volunteers; a hostile agent (the real agent
with a function replaced, ``programs/hostile_agent.py``) that forges its ranks' output, or
their messages, is caught and never has its forgery reported as the job's result.

The module's pool: 3 honest agents, each admitted by a join token of its own, and 2 relays.
The hostile agents join with a token of their own and offer the most slots, so the job's
rank 0 goes to them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Pool

PROGRAMS = Path(__file__).parent / "programs"
PROGRAM = str(PROGRAMS / "exchange_pi.py")
BIN = Path(sys.executable).parent
TRUE_PI = "3.141592653598"  # the midpoint rule on 100000 intervals
PI_LINES = [f"rank {r}: pi = {TRUE_PI}" for r in range(2)]


def _dir(pool: Pool) -> Path:
    return pool.home / "state" / "local-pool"


def _operator(pool: Pool, *args: str) -> str:
    config = str(_dir(pool) / "coordinator" / "config.toml")
    res = subprocess.run(
        [str(BIN / "vpool-coordinator"), *args, "--config", config],
        capture_output=True, timeout=60, check=False, env=pool.env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr.decode()
    return res.stdout.decode()


def _status(pool: Pool, job: int | None = None) -> dict:
    return pool.detail(job)


def _wait_for(cond, what: str, pool: Pool, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout} s\n{pool.logs()}")
        time.sleep(0.1)
    return got


def _validated_run(pool: Pool) -> tuple[int, dict, list[str]]:
    """Submit exchange_pi.py on 2 ranks with --validate and wait for it: (`vsdk wait`'s exit
    code, the job's detail, its stdout lines sorted)."""
    res = pool.vsdk("submit", PROGRAM, "-n", "2", "--validate", "--json", timeout=60)
    assert res.returncode == 0, res.stderr.decode()
    job = int(json.loads(res.stdout)["id"])
    code = pool.vsdk("wait", str(job), "--timeout", "300", timeout=320).returncode
    out = pool.vsdk("logs", str(job), timeout=60).stdout.decode()
    return code, _status(pool, job), sorted(out.splitlines())


class Hostile:
    """A hostile agent process in the module's pool, admitted by a join token of its own."""

    def __init__(self, pool: Pool, name: str, mode: str, tmp: Path) -> None:
        token = _operator(pool, "join-token", "create", "--uses", "1", "--label", name).strip()
        honest = tomllib.loads((_dir(pool) / "agent-0" / "config.toml").read_text())
        lines = [
            f'name = "{name}"',
            f'coordinator_url = "{honest["coordinator_url"]}"',
            f'coordinator_ca = "{honest["coordinator_ca"]}"',
            f'join_token = "{token}"',
            f'identity_dir = "{tmp / "identity"}"',
            f'work_dir = "{tmp / "work"}"',
            "slots = 64",
        ]
        tmp.mkdir(parents=True, exist_ok=True)
        config = tmp / "config.toml"
        config.write_text("\n".join(lines) + "\n")
        self.name = name
        self.log = tmp / "agent.log"
        argv = [sys.executable, str(PROGRAMS / "hostile_agent.py"), mode, "--config", str(config)]
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env={**pool.env}
            )
        # In the pool once it has told how it isolates ranks (it gets no rank before).
        _wait_for(
            lambda: any(
                a["name"] == name and a["isolation"] and a["state"] == "alive"
                for a in _status(pool)["agents"]
            ),
            f"hostile agent {name} joins",
            pool,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.fixture
def hostile(pool: Pool, tmp_path: Path):
    """``hostile(mode)`` starts one; each is banned and killed at the end of its test."""
    started: list[Hostile] = []

    def start(mode: str) -> Hostile:
        h = Hostile(pool, f"hostile-{mode}", mode, tmp_path / mode)
        started.append(h)
        return h

    yield start
    for h in started:
        _operator(pool, "agent", "ban", h.name, "--reason", "forged results in a test")
        h.stop()


def test_an_honest_validated_job_gives_the_output_of_mpiexec(pool: Pool) -> None:
    code, detail, lines = _validated_run(pool)
    assert code == 0, detail
    assert lines == PI_LINES
    job = detail["job"]
    assert job["validate"] and job["state"] == "succeeded"
    assert job["validation"].startswith("validated: rank(s) 0, 1 re-executed and confirmed")
    for r in detail["ranks"]:
        # Re-executed on another agent than the one that ran it (each agent has its own
        # join token here), and it agreed.
        assert r["validation"] == "agreed", r
        assert r["incarnation"] == 2
    res = pool.vsdk("mpiexec", "-n", "2", sys.executable, PROGRAM, timeout=120)
    assert res.returncode == 0, res.stderr.decode()
    assert sorted(res.stdout.decode().splitlines()) == PI_LINES


def test_forged_output_is_caught_and_replaced_by_the_agreed_one(pool: Pool, hostile) -> None:
    h = hostile("output")
    code, detail, lines = _validated_run(pool)
    assert code == 0, (detail, h.log.read_text()[-3000:])
    assert lines == PI_LINES  # the forged "pi = 3.000000000000" is nowhere
    job, ranks = detail["job"], detail["ranks"]
    assert job["state"] == "succeeded", job
    assert "corrected" in job["validation"], job["validation"]
    assert ranks[0]["validation"] == "corrected", ranks
    kinds = [(e["kind"], e["message"]) for e in detail["events"]]
    assert any(k == "agent_distrusted" and h.name in m for k, m in kinds), kinds
    assert any(k == "validation_corrected" and h.name in m for k, m in kinds), kinds


def test_forged_messages_fail_the_job_naming_the_rank_and_agent(pool: Pool, hostile) -> None:
    h = hostile("messages")
    code, detail, lines = _validated_run(pool)
    job = detail["job"]
    assert job["state"] == "failed", (job, h.log.read_text()[-3000:])
    assert code != 0
    assert f"rank 0's run on agent {h.name} sent other messages" in job["reason"], job
    # Rank 1 computed with the forged part: its line was wrong, and the job did not pass it
    # off as a result (it failed, naming why).
    assert f"rank 1: pi = {TRUE_PI}" not in lines
    assert ranks_validation(detail)[0] == "disagreed"


def ranks_validation(detail: dict) -> dict[int, str]:
    return {r["rank"]: r["validation"] for r in detail["ranks"]}
