"""A second `vsdk local up` keeps the jobs of the first (issue 18): `vsdk jobs` and `vsdk
results` still show them; the ones it left unfinished are cancelled; --fresh starts anew."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.integration.conftest import BIN, REPO

if TYPE_CHECKING:
    from conftest import Pool

PI = str(REPO / "examples" / "pi.py")


def _jobs(pool: Pool) -> dict[int, str]:
    res = pool.vsdk("jobs", "--json")
    assert res.returncode == 0, res.stderr.decode()
    return {j["id"]: j["state"] for j in json.loads(res.stdout)}


@pytest.mark.slow
def test_jobs_survive_local_down_and_up(fresh_pool: Pool, tmp_path: Path) -> None:
    pool = fresh_pool
    done = pool.vsdk("submit", PI, "--ranks", "2", "--wait", "--", "1000")
    assert done.returncode == 0, done.stderr.decode()
    blocker = tmp_path / "block.py"
    blocker.write_text("from mpi4py import MPI\nMPI.COMM_WORLD.recv(source=1)\n")
    left = pool.vsdk("submit", str(blocker), "--ranks", "2")
    assert left.returncode == 0, left.stderr.decode()
    before = _jobs(pool)
    assert before[1] == "succeeded" and before[2] in ("queued", "running")

    assert pool.vsdk("local", "down").returncode == 0
    # A database from before roles had "local" as a plain user: up makes it an operator.
    config = pool.home / "state" / "local-pool" / "coordinator" / "config.toml"
    demote = subprocess.run(
        [str(BIN / "vpool-coordinator"), "user", "role", "local", "user", "--config", str(config)],
        capture_output=True,
        check=False,
        timeout=60,
    )
    assert demote.returncode == 0, demote.stderr.decode()
    again = pool.vsdk("local", "up", "--agents", "1", "--relays", "1", timeout=120)
    assert again.returncode == 0, again.stderr.decode()
    said = again.stderr.decode()
    assert "keeping the jobs of the previous local pool" in said
    assert "cancelled job(s) 2" in said
    assert _jobs(pool) == {1: "succeeded", 2: "cancelled"}
    got = pool.vsdk("results", "1", str(tmp_path / "results"))
    assert got.returncode == 0, got.stderr.decode()
    text = b"".join(p.read_bytes() for p in (tmp_path / "results").rglob("*") if p.is_file())
    assert b"pi is approximately" in text
    # New jobs run on the new pool, numbered after the old ones.
    new = pool.vsdk("submit", PI, "--ranks", "1", "--wait", "--", "1000")
    assert new.returncode == 0, new.stderr.decode()
    assert _jobs(pool)[3] == "succeeded"

    fresh = pool.vsdk("local", "up", "--force", "--fresh", "--agents", "1", "--relays", "1")
    assert fresh.returncode == 0, fresh.stderr.decode()
    assert "keeping" not in fresh.stderr.decode()
    assert _jobs(pool) == {}
