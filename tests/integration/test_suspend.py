"""Suspend, don't kill (issue 22): a real local pool whose agents yield to their owners.

The owner's commands (`vpool-agent pause`, `resume`, `status`) reach a running agent through its
control socket; the battery is read from a power-supply tree the test writes (the agent's
``power_supply_dir``); a rank frozen past ``suspend_limit`` is checkpointed with the real CRIU
and restored on the other agent. Frozen means frozen by the kernel: the rank's freezer cgroup
says FROZEN. Every job's output is compared with a fault-free run of the same program.
"""

from __future__ import annotations

import datetime as dt
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.integration.conftest import end_process
from tests.integration.test_checkpoints import (
    detail,
    ended,
    events,
    output,
    reference,
    submit,
    wait_agents,
    wait_until,
)

if TYPE_CHECKING:
    from conftest import Pool

pytestmark = pytest.mark.slow

AGENT = [sys.executable, "-m", "vpool.worker_agent.cli"]


@pytest.fixture
def pool(tmp_path: Path) -> Any:
    from tests.integration.conftest import start_pool

    p = start_pool(tmp_path / "home", agents=2, relays=1)
    try:
        yield p
    finally:
        p.vsdk("local", "down", timeout=60)


def config(pool: Pool, name: str) -> Path:
    return pool.home / "state" / "local-pool" / name / "config.toml"


def owner(pool: Pool, name: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``vpool-agent --config <name's> ARGS``: what the machine's owner types."""
    return subprocess.run(
        [*AGENT, "--config", str(config(pool, name)), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env=pool.env,
    )


def agent_status(pool: Pool, name: str) -> dict[str, Any]:
    res = owner(pool, name, "status", "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)  # type: ignore[no-any-return]


def reconfigure(pool: Pool, name: str, **settings: object) -> None:
    """Restart agent ``name`` with ``settings`` added to its config file."""
    path = config(pool, name)
    kept = [ln for ln in path.read_text().splitlines() if ln.split(" ")[0] not in settings]
    added = [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    path.write_text("\n".join([*kept, *added, ""]))
    end_process(pool.pid_of(name), signal.SIGKILL, 30)
    res = pool.vsdk("local", "restart", name)
    assert res.returncode == 0, res.stderr.decode()


def freezer_state(pid: int) -> str:
    """The state of the freezer cgroup of process ``pid`` ("" where there is none)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "freezer" in controllers.split(","):
            return (
                (Path("/sys/fs/cgroup/freezer") / path.lstrip("/") / "freezer.state")
                .read_text()
                .strip()
            )
        if controllers == "":
            f = Path("/sys/fs/cgroup") / path.lstrip("/") / "cgroup.freeze"
            if f.exists():
                return "FROZEN" if f.read_text().strip() == "1" else "THAWED"
    return ""


def wait_for(what: str, cond: Callable[[], Any], pool: Pool, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"{what}: not after {timeout} s\n{pool.logs()}"
        time.sleep(0.05)
    return got


def running_on(pool: Pool, job: int, name: str) -> list[int]:
    """The ranks of ``job`` running on agent ``name`` once all its ranks run."""
    agent_id = json.loads(
        (pool.home / "state" / "local-pool" / "run" / f"{name}.ready.json").read_text()
    )["agent_id"]
    d = wait_until(
        pool,
        job,
        lambda d: ended(d) or all(r["state"] == "running" for r in d["ranks"]),
        "every rank running",
    )
    assert not ended(d), d
    return sorted(r["rank"] for r in d["ranks"] if r["agent"] == agent_id)


def test_paused_ranks_are_frozen_then_thawed_and_the_output_is_identical(pool: Pool) -> None:
    ref = reference(4, "200")
    job = submit(pool, 4, "200")
    wait_until(pool, job, lambda d: ended(d) or b"step 20:" in output(pool, job), "progress")
    mine = running_on(pool, job, "agent-0")
    assert mine, "agent-0 runs none of the ranks"
    pids = [pool.rank_pid(rank, job, "agent-0") for rank in mine]

    res = owner(pool, "agent-0", "pause", "--for", "10m")
    assert res.returncode == 0, res.stderr
    assert res.stdout == "paused: paused by its owner (for 10 min more)\n", res.stdout
    for pid in pids:
        assert freezer_state(pid) == "FROZEN", pid
    st = agent_status(pool, "agent-0")
    assert st["activity"] == "suspended" and st["paused"], st
    assert sorted(r["rank"] for r in st["ranks"] if r["state"] == "suspended") == mine, st
    assert {r["user"] for r in st["ranks"]} == {"local"}, st
    text = owner(pool, "agent-0", "status").stdout
    assert "state:      suspended: paused by its owner" in text, text

    res = owner(pool, "agent-0", "resume")
    assert res.returncode == 0 and res.stdout == "resumed; now running\n", (res.stdout, res.stderr)
    for pid in pids:
        assert freezer_state(pid) == "THAWED", pid

    # The owner's preferences, changed while it runs: hours that exclude now freeze the
    # ranks at once; any hour again thaws them. The file keeps what was said.
    start = (dt.datetime.now() + dt.timedelta(hours=2)).strftime("%H:00")
    end = (dt.datetime.now() + dt.timedelta(hours=3)).strftime("%H:00")
    res = owner(pool, "agent-0", "prefs", "--run-hours", f"{start}-{end}", "--cores", "6")
    assert res.returncode == 0, res.stderr
    assert f"hours:        {start}-{end}" in res.stdout, res.stdout
    assert res.stdout.endswith("the running agent applied them\n"), res.stdout
    wait_for(
        "ranks frozen outside the hours",
        lambda: all(freezer_state(p) == "FROZEN" for p in pids),
        pool,
    )
    st = agent_status(pool, "agent-0")
    assert st["reason"] == f"outside its hours ({start}-{end})", st
    assert st["limits"]["slots"] == 6, st
    assert f'run_hours = "{start}-{end}"' in config(pool, "agent-0").read_text()
    res = owner(pool, "agent-0", "prefs", "--run-hours", "")
    assert res.returncode == 0 and "hours:        any" in res.stdout, (res.stdout, res.stderr)
    wait_for("ranks thawed", lambda: all(freezer_state(p) == "THAWED" for p in pids), pool)
    bad = owner(pool, "agent-0", "prefs", "--run-hours", "9-17")
    assert bad.returncode == 2 and "is not HH:MM-HH:MM" in bad.stderr, bad.stderr
    assert 'run_hours = ""' in config(pool, "agent-0").read_text()  # nothing written

    d = wait_until(pool, job, ended, "job end", timeout=120)
    assert d["job"]["state"] == "succeeded", (d, pool.logs())
    assert output(pool, job) == ref.result()
    assert not events(d, "rank_lost"), d["events"]  # suspended, never lost
    suspended = events(d, "rank_suspended")
    assert {e["rank"] for e in suspended} == set(mine), d["events"]
    assert "paused by its owner" in suspended[0]["message"], suspended


def test_status_pause_and_resume_answer_clearly_without_an_agent(tmp_path: Path) -> None:
    sock = tmp_path / "control.sock"
    res = subprocess.run(
        [*AGENT, "status", "--socket", str(sock)], capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 1
    assert res.stderr == f"vpool-agent: no agent is running here (nothing answers at {sock})\n"
    res = subprocess.run(
        [*AGENT, "pause", "--for", "soon", "--socket", str(sock)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 2 and "'soon' is not a duration" in res.stderr, res.stderr


def test_a_rank_suspended_past_the_limit_moves_to_another_machine(pool: Pool) -> None:
    ref = reference(4, "300")
    reconfigure(pool, "agent-0", suspend_limit=2.0)
    wait_agents(pool, 2)
    job = submit(pool, 4, "300")
    wait_until(pool, job, lambda d: ended(d) or b"step 20:" in output(pool, job), "progress")
    mine = running_on(pool, job, "agent-0")
    assert mine, "agent-0 runs none of the ranks"
    assert owner(pool, "agent-0", "pause").returncode == 0
    # Frozen, then after 2 s thawed, checkpointed and stopped: restored on agent-1.
    d = wait_until(
        pool,
        job,
        lambda d: ended(d) or all(events(d, "rank_restored", r) for r in mine),
        "the suspended ranks restored elsewhere",
        timeout=120,
    )
    assert not ended(d), d["events"]
    for rank in mine:
        lost = events(d, "rank_lost", rank)
        assert lost and "suspended for more than 2 s" in lost[-1]["message"], d["events"]
        assert events(d, "checkpoint", rank), d["events"]
    d = wait_until(pool, job, ended, "job end", timeout=120)
    assert d["job"]["state"] == "succeeded", (d, pool.logs())
    assert output(pool, job) == ref.result()
    st = agent_status(pool, "agent-0")
    assert st["activity"] == "suspended" and not st["ranks"], st
    assert detail(pool, job) is not None


def test_battery_suspends_and_mains_power_thaws(pool: Pool, tmp_path: Path) -> None:
    supplies = tmp_path / "power_supply"
    for name, files in {
        "AC": {"type": "Mains", "online": "1"},
        "BAT0": {"type": "Battery", "status": "Charging", "capacity": "80"},
    }.items():
        (supplies / name).mkdir(parents=True)
        for key, value in files.items():
            (supplies / name / key).write_text(value + "\n")
    ref = reference(4, "200")
    reconfigure(pool, "agent-0", power_supply_dir=str(supplies), manners_interval=0.2)
    wait_agents(pool, 2)
    job = submit(pool, 4, "200")
    wait_until(pool, job, lambda d: ended(d) or b"step 20:" in output(pool, job), "progress")
    mine = running_on(pool, job, "agent-0")
    assert mine
    pids = [pool.rank_pid(rank, job, "agent-0") for rank in mine]
    unplugged = time.time()
    (supplies / "AC" / "online").write_text("0\n")
    (supplies / "BAT0" / "status").write_text("Discharging\n")
    wait_for(
        "ranks frozen on battery", lambda: all(freezer_state(p) == "FROZEN" for p in pids), pool
    )
    st = agent_status(pool, "agent-0")
    assert st["reason"] == "running on battery, 80% left", st
    (supplies / "AC" / "online").write_text("1\n")
    wait_for("ranks thawed on mains", lambda: all(freezer_state(p) == "THAWED" for p in pids), pool)
    d = wait_until(pool, job, ended, "job end", timeout=120)
    assert d["job"]["state"] == "succeeded", (d, pool.logs())
    assert output(pool, job) == ref.result()
    # Suspended, never lost. (A lease handed to agent-0 as it was restarted above may have
    # cost a rank an incarnation before: that loss comes earlier.)
    assert not [e for e in events(d, "rank_lost") if e["time"] >= unplugged], d["events"]
