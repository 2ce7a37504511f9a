"""Transparent fault tolerance on a real local pool: kill things mid-job, get the same output.

Each test starts its own pool (`vsdk local up --timers test`: real coordinator, relays and agents
as separate processes, with heartbeats and timeouts a few times shorter than a real pool's), runs
an example while SIGKILLing (or SIGSTOPping) one component by its recorded pid, and checks that
the job succeeds with the output of a fault-free run under real `mpiexec`, byte for byte, and
that the job's events tell what happened.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.integration.conftest import reference
from vpool.sdk.localpool import TIMERS

if TYPE_CHECKING:
    from conftest import Pool

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

HEAT = str(REPO / "examples" / "heat.py")
# Long enough that each fault lands mid-job (a relay down or an agent frozen holds the job up
# until it is back, a killed rank has been sent messages to replay), short enough that the job
# and its fault-free reference under MPICH's mpiexec (8 ranks spinning on 2 cores) take about
# half a minute each, not minutes.
HEAT_STEPS = "1500"
FARM = str(REPO / "examples" / "farm.py")


def submit(pool: Pool, program: str, ranks: int, *args: str) -> int:
    res = pool.vsdk("submit", program, "--ranks", str(ranks), "--json", "--", *args)
    assert res.returncode == 0, res.stderr.decode()
    return int(json.loads(res.stdout)["id"])


def detail(pool: Pool, job: int) -> dict | None:
    return pool.status(job)  # None: the coordinator may be restarting


def wait_until(pool: Pool, job: int, cond, what: str, timeout: float = 120) -> dict:
    return pool.wait(job, cond, what, timeout)


def all_running(d: dict) -> bool:
    return d["job"]["state"] == "running" and all(r["state"] == "running" for r in d["ranks"])


def ended(d: dict) -> bool:
    return d["job"]["state"] in ("succeeded", "failed", "cancelled")


def output(pool: Pool, job: int) -> bytes:
    res = pool.vsdk("logs", str(job))
    assert res.returncode == 0, res.stderr.decode()
    return res.stdout


def rank_pid(pool: Pool, rank: int, job: int) -> int:
    return pool.rank_pid(rank, job)


def agent_name(pool: Pool, agent_id: str) -> str:
    """The pool's process name (agent-N) of the agent the coordinator knows as ``agent_id``."""
    for ready in (pool.home / "state" / "local-pool" / "run").glob("agent-*.ready.json"):
        info = json.loads(ready.read_text())
        if info.get("agent_id") == agent_id:
            return str(info["name"])
    raise AssertionError(f"no agent of the pool has id {agent_id}")


def kinds(d: dict) -> list[str]:
    return [e["kind"] for e in d["events"]]


def logged_bytes(pool: Pool, job: int, rank: int) -> int:
    """Bytes of messages for ``rank`` in its home relay's log: how far the job has got."""
    total = 0
    for seg in (pool.home / "state" / "local-pool").glob(f"relay-*/data/jobs/{job}/{rank}/*.seg"):
        try:
            total += seg.stat().st_size
        except FileNotFoundError:
            pass
    return total


POLL = str(REPO / "examples" / "poll.py")


@pytest.mark.parametrize(
    ("program", "args", "victim"),
    [
        (HEAT, [HEAT_STEPS], 3),  # Sendrecv halos
        (FARM, ["8000"], 0),  # the master: ANY_SOURCE receives, replayed from determinants
        (POLL, ["3000"], 0),  # Waitany and Iprobe polling, replayed from determinants
    ],
    ids=["heat-rank3", "farm-master", "poll-master"],
)
def test_killed_rank_is_replaced_and_output_is_identical(
    pool4: Pool, program: str, args: list[str], victim: int
) -> None:
    ref = reference(program, 8, *args)
    job = submit(pool4, program, 8, *args)
    # (Not "all running": poll.py's workers may send everything and exit early.)
    wait_until(
        pool4,
        job,
        lambda d: ended(d) or d["ranks"][victim]["state"] == "running",
        f"rank {victim} running",
    )
    # Let the victim receive messages first: its replacement must replay them. Watched on the
    # relays' files alone, every 10 ms: a `vsdk status` per look would react too late for a
    # job of a few seconds, which could end before the kill.
    deadline = time.monotonic() + 120
    while logged_bytes(pool4, job, victim) <= 20_000:
        assert time.monotonic() < deadline, f"rank {victim} got no messages\n{pool4.logs()}"
        time.sleep(0.01)
    os.kill(rank_pid(pool4, victim, job), signal.SIGKILL)
    killed = time.monotonic()
    d = wait_until(
        pool4,
        job,
        lambda d: (
            ended(d)
            or any(
                r["rank"] == victim and r["incarnation"] >= 2 and r["state"] == "running"
                for r in d["ranks"]
            )
        ),
        f"replacement of rank {victim} running",
    )
    replaced_after = time.monotonic() - killed
    d = wait_until(pool4, job, ended, "job end")
    assert d["job"]["state"] == "succeeded", (d, pool4.logs())
    assert output(pool4, job) == ref
    assert "rank_lost" in kinds(d) and "rank_restarted" in kinds(d), d["events"]
    assert "rank_replaying" in kinds(d), d["events"]
    print(f"rank {victim} replaced {replaced_after:.2f} s after its SIGKILL")
    assert replaced_after < 10


def test_killed_agent_ranks_move_and_output_is_identical(pool4: Pool) -> None:
    ref = reference(FARM, 8, "3000")
    job = submit(pool4, FARM, 8, "3000")
    d = wait_until(pool4, job, all_running, "all ranks running")
    os.kill(pool4.pid_of(agent_name(pool4, d["ranks"][2]["agent"])), signal.SIGKILL)
    d = wait_until(pool4, job, ended, "job end", timeout=180)
    assert d["job"]["state"] == "succeeded", (d, pool4.logs())
    assert output(pool4, job) == ref
    assert "rank_restarted" in kinds(d)


@pytest.mark.parametrize("component", ["relay-0", "coordinator"])
def test_restarted_relay_or_coordinator_loses_nothing(pool4: Pool, component: str) -> None:
    ref = reference(HEAT, 8, HEAT_STEPS)
    job = submit(pool4, HEAT, 8, HEAT_STEPS)
    wait_until(pool4, job, all_running, "all ranks running")
    wait_until(pool4, job, lambda d: ended(d) or b"step " in output(pool4, job), "first steps")
    log = pool4.home / "state" / "local-pool" / "logs" / f"{component}.log"
    os.kill(pool4.pid_of(component), signal.SIGKILL)
    before = log.read_bytes()
    res = pool4.vsdk("local", "restart", component)
    assert res.returncode == 0, res.stderr.decode()
    d = wait_until(pool4, job, ended, "job end", timeout=180)
    assert d["job"]["state"] == "succeeded", (d, pool4.logs())
    assert output(pool4, job) == ref
    # The log of the run that was killed is kept, the restarted one's after it.
    after = log.read_bytes()
    assert before and after.startswith(before), (len(before), len(after))
    assert f"--- vsdk local restart {component} at ".encode() in after[len(before) :]


def test_a_long_relay_outage_is_waited_out_without_spending_restarts(pool4: Pool) -> None:
    """relay-0 stays down past the agents' relay_reconnect (8 s on the test timers, 30 s by
    default): its ranks are lost, but their replacements wait for it (no restart budget burnt
    on a relay nobody can reach), and the job goes on once it is back."""
    ref = reference(HEAT, 8, HEAT_STEPS)
    job = submit(pool4, HEAT, 8, HEAT_STEPS)
    wait_until(pool4, job, all_running, "all ranks running")
    wait_until(pool4, job, lambda d: ended(d) or b"step " in output(pool4, job), "first steps")
    os.kill(pool4.pid_of("relay-0"), signal.SIGKILL)
    d = wait_until(
        pool4,
        job,
        lambda d: ended(d) or any("not counted as a restart" in e["message"] for e in d["events"]),
        "ranks lost to the relay's outage",
        timeout=90,
    )
    assert not ended(d) and "relay_down" in kinds(d), d["events"]
    res = pool4.vsdk("local", "restart", "relay-0")
    assert res.returncode == 0, res.stderr.decode()
    d = wait_until(pool4, job, ended, "job end", timeout=180)
    assert d["job"]["state"] == "succeeded", (d, pool4.logs())
    assert output(pool4, job) == ref
    assert d["job"]["restarts"] == 0, d["events"]


def test_frozen_agent_is_replaced_and_fenced_when_it_wakes(pool4: Pool) -> None:
    ref = reference(HEAT, 8, HEAT_STEPS)
    job = submit(pool4, HEAT, 8, HEAT_STEPS)
    d = wait_until(pool4, job, all_running, "all ranks running")
    victim = d["ranks"][1]["agent"]
    pid = pool4.pid_of(agent_name(pool4, victim))
    stale = [rank_pid(pool4, r["rank"], job) for r in d["ranks"] if r["agent"] == victim]
    for p in [pid, *stale]:
        os.kill(p, signal.SIGSTOP)  # a suspended laptop: its TCP connections stay up
    frozen = time.monotonic()
    try:
        wait_until(
            pool4,
            job,
            lambda d: (
                ended(d)
                or all(r["agent"] != victim and r["state"] == "running" for r in d["ranks"])
            ),
            "ranks of the frozen agent moved",
            timeout=60,
        )
        moved_after = time.monotonic() - frozen
    finally:
        for p in [pid, *stale]:
            os.kill(p, signal.SIGCONT)
    print(f"ranks of the frozen agent running elsewhere {moved_after:.1f} s after SIGSTOP")
    # The replacements run within the pool's agent_timeout (4 s on the test timers) plus
    # scheduling and start-up.
    assert moved_after < TIMERS["test"]["coordinator"]["agent_timeout"] + 6
    # Awake again, its stale incarnations are told to stop and are recorded as fenced.
    d = wait_until(pool4, job, lambda d: "rank_fenced" in kinds(d), "stale ranks fenced")
    d = wait_until(pool4, job, ended, "job end", timeout=180)
    assert d["job"]["state"] == "succeeded", (d, pool4.logs())
    assert output(pool4, job) == ref


def test_nondeterministic_program_that_loses_a_rank_fails_clearly(pool4: Pool) -> None:
    program = str(REPO / "tests" / "integration" / "programs" / "random_sender.py")
    job = submit(pool4, program, 4)
    wait_until(pool4, job, all_running, "all ranks running")
    wait_until(pool4, job, lambda d: ended(d) or _said_ready(pool4, job), "first exchange")
    os.kill(rank_pid(pool4, 1, job), signal.SIGKILL)
    d = wait_until(pool4, job, ended, "job end", timeout=120)
    assert d["job"]["state"] == "failed", d
    assert "not deterministic" in d["job"]["reason"], d["job"]["reason"]


def _said_ready(pool: Pool, job: int) -> bool:
    return b"exchanged" in output(pool, job)
