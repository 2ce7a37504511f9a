"""Failure modes on a real local pool (``vsdk submit --on-failure``): ranks SIGKILLed at random
while a program that recovers the ULFM way (examples/ulfm_shrink.py: revoke, agree, shrink, go
on) runs. In "ulfm" mode it finishes with the right answer; in "abort" mode the same program
fails cleanly, the job naming the lost rank. In FT-MPI's modes (blank, shrink, rebuild) a
program that recovers the FT-MPI way (examples/ftmpi_modes.py: rebuild ``MPI.COMM_WORLD`` with
``Dup``, go on) finishes with the right answer too; in rebuild mode the pool starts a fresh
process in each lost rank's place.

The victims and the moments are drawn from a seeded generator (the seed is in the assertion
messages); each kill waits until the job has made progress, so it lands mid-run.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Pool

REPO = Path(__file__).resolve().parents[2]
PROGRAM = str(REPO / "examples" / "ulfm_shrink.py")
FTMPI_PROGRAM = str(REPO / "examples" / "ftmpi_modes.py")
N, ITERATIONS = "60000", "400"
FTMPI_N = "20000"  # less work per iteration: its iterations carry more messages

pytestmark = pytest.mark.slow


@functools.cache
def _reference(program: str = PROGRAM, n: str = N) -> str:
    """The program's answer, from a fault-free run under ``vsdk mpiexec`` (once per test
    session: the three FT-MPI modes' tests compare with the same run)."""
    proc = subprocess.run(
        [sys.executable, "-m", "vpool.sdk.mpiexec", "-n", "2", "--", program, n, ITERATIONS],
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    return proc.stdout.decode()


def _submit(pool: Pool, mode: str, ranks: int, program: str = PROGRAM, n: str = N) -> int:
    res = pool.vsdk(
        "submit",
        program,
        "--ranks",
        str(ranks),
        "--on-failure",
        mode,
        "--json",
        "--",
        n,
        ITERATIONS,
    )
    assert res.returncode == 0, res.stderr.decode()
    return int(json.loads(res.stdout)["id"])


def _progress(pool: Pool, job: int) -> int:
    """Bytes the ranks' messages took on the relays so far: how far the job has got."""
    total = 0
    for seg in (pool.home / "state" / "local-pool").glob(f"relay-*/data/jobs/{job}/*/*.seg"):
        try:
            total += seg.stat().st_size
        except FileNotFoundError:
            pass
    return total


def _kill_at_random(pool: Pool, job: int, victims: list[int], rng: random.Random) -> list[float]:
    """SIGKILL each victim once the job has moved on by a random amount; when each died."""
    killed = []
    for victim in victims:
        start = _progress(pool, job)
        goal = start + rng.randrange(2_000, 20_000)
        deadline = time.monotonic() + 120
        while _progress(pool, job) < goal:
            assert time.monotonic() < deadline, f"job {job} made no progress\n{pool.logs()}"
            time.sleep(0.01)
        os.kill(pool.rank_pid(victim, job), signal.SIGKILL)
        killed.append(time.time())
    return killed


def test_a_ulfm_program_shrinks_past_random_kills_and_gets_the_right_answer(
    fresh_pool: Pool,
) -> None:
    reference = _reference()
    seed = int(os.environ.get("VPOOL_CHAOS_SEED", str(int(time.time()))))
    rng = random.Random(seed)
    victims = rng.sample(range(1, 6), 2)  # rank 0 prints; any other may die
    job = _submit(fresh_pool, "ulfm", 6)
    fresh_pool.wait(job, lambda d: all(r["state"] == "running" for r in d["ranks"]), "running")
    killed = _kill_at_random(fresh_pool, job, victims, rng)
    d = fresh_pool.wait(job, lambda d: d["job"]["state"] != "running", "the job ends", 300)
    why = f"seed {seed}, victims {victims}: {d['job']}\n{fresh_pool.logs()}"
    assert d["job"]["state"] == "succeeded", why
    assert sorted(d["job"]["failed_ranks"]) == sorted(victims), why
    assert {r["rank"]: r["state"] for r in d["ranks"]} == {
        r: "failed" if r in victims else "exited" for r in range(6)
    }, why
    res = fresh_pool.vsdk("logs", str(job))
    assert res.stdout.decode() == reference, why
    # Every failure was declared (and so told to the others) within seconds of the kill.
    declared = sorted(e["time"] for e in d["events"] if e["kind"] == "rank_failed")
    assert len(declared) == 2, why
    delays = [when - kill for kill, when in zip(sorted(killed), declared, strict=True)]
    print(f"kill -> declared failed: {', '.join(f'{d:.2f} s' for d in delays)}")
    assert all(d < 15 for d in delays), why


def test_the_same_program_in_abort_mode_fails_cleanly(fresh_pool: Pool) -> None:
    job = _submit(fresh_pool, "abort", 4)
    fresh_pool.wait(job, lambda d: all(r["state"] == "running" for r in d["ranks"]), "running")
    _kill_at_random(fresh_pool, job, [2], random.Random(2))
    d = fresh_pool.wait(job, lambda d: d["job"]["state"] != "running", "the job ends", 120)
    assert d["job"]["state"] == "failed", d["job"]
    assert d["job"]["reason"].startswith("rank 2 lost: its process on agent"), d["job"]
    assert "killed by SIGKILL" in d["job"]["reason"]
    assert [r["rank"] for r in d["ranks"] if r["state"] == "lost"] == [2]
    # Nothing was restarted, and the other ranks are stopped.
    assert d["job"]["restarts"] == 0
    deadline = time.monotonic() + 60
    while any(j == job for j, _, _ in fresh_pool.rank_processes()):
        assert time.monotonic() < deadline, f"ranks of job {job} still run\n{fresh_pool.logs()}"
        time.sleep(0.05)


@pytest.mark.parametrize("mode", ["blank", "shrink", "rebuild"])
def test_an_ftmpi_program_rebuilds_its_world_past_random_kills(fresh_pool: Pool, mode: str) -> None:
    reference = _reference(FTMPI_PROGRAM, FTMPI_N)
    seed = int(os.environ.get("VPOOL_CHAOS_SEED", str(int(time.time()))))
    rng = random.Random(seed)
    victims = rng.sample(range(5), 2)  # rank 0 too: the first live rank prints
    job = _submit(fresh_pool, mode, 5, FTMPI_PROGRAM, FTMPI_N)
    fresh_pool.wait(job, lambda d: all(r["state"] == "running" for r in d["ranks"]), "running")
    _kill_at_random(fresh_pool, job, victims, rng)
    d = fresh_pool.wait(job, lambda d: d["job"]["state"] != "running", "the job ends", 300)
    why = f"{mode}, seed {seed}, victims {victims}: {d['job']}\n{fresh_pool.logs()}"
    assert d["job"]["state"] == "succeeded", why
    assert sorted(d["job"]["failed_ranks"]) == sorted(victims), why
    states = {r["rank"]: r["state"] for r in d["ranks"]}
    first = {r: s for r, s in states.items() if r < 5}
    assert first == {r: "failed" if r in victims else "exited" for r in range(5)}, why
    spawned = {r: s for r, s in states.items() if r >= 5}
    if mode == "rebuild":
        # A fresh process, spawned, took each lost rank's place (one recovery may replace
        # both; one interrupted by the second kill may have started some that were not
        # needed, which end at once): every one exited.
        assert len(spawned) >= len(victims), why
        assert set(spawned.values()) == {"exited"}, why
    else:
        assert spawned == {}, why
    res = fresh_pool.vsdk("logs", str(job))
    assert res.stdout.decode() == reference, why
