"""``vsdk submit --memory / --allow-unsandboxed``: documented, checked, sent in ``JobSubmit``
and shown by ``vsdk status JOB``; ``vsdk status`` without a job lists the pool's agents with
their isolation and the memory a rank may use on each."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner

from vpool.protocol.api import AgentInfo
from vpool.sdk.cli import cli

MiB, GiB = 1024**2, 1024**3


def run(*args: str):  # type: ignore[no-untyped-def]
    return CliRunner().invoke(cli, list(args))


@pytest.fixture
def app(tmp_path: Path) -> Path:
    (tmp_path / "app.py").write_text("print('hi')\n")
    return tmp_path / "app.py"


def test_help_documents_the_flags() -> None:
    res = run("submit", "--help")
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "--memory SIZE" in res.output and "--allow-unsandboxed" in res.output
    assert "e.g. 512M, 2G, 1.5GiB (powers of 1024) or bytes" in text
    assert "vsdk submit sim.py -n 16 --memory 2G --wait" in res.output
    assert "vsdk submit trusted.py -n 4 --allow-unsandboxed" in res.output
    res = run("status", "--help")
    assert res.exit_code == 0, res.output
    assert "Without JOB, show the pool" in " ".join(res.output.split())


def test_submit_sends_memory_and_unsandboxed(coord: Any, app: Path) -> None:
    res = run("submit", str(app), "-n", "2")
    assert res.exit_code == 0, res.output
    assert (coord.jobs[1].submit.memory, coord.jobs[1].submit.unsandboxed) == (0, False)

    res = run("submit", str(app), "-n", "2", "--memory", "1.5GiB", "--allow-unsandboxed")
    assert res.exit_code == 0, res.output
    assert (coord.jobs[2].submit.memory, coord.jobs[2].submit.unsandboxed) == (3 * GiB // 2, True)
    assert "(2 ranks, 1.5 GiB per rank, unsandboxed agents allowed)" in res.stderr

    for given, expected in (("512M", 512 * MiB), ("2G", 2 * GiB), (str(GiB), GiB), ("0", 0)):
        res = run("submit", str(app), "-n", "1", "--memory", given, "--", "--memory", "x")
        assert res.exit_code == 0, res.output
        job = coord.jobs[int(res.stdout)]
        assert job.submit.memory == expected
        assert job.submit.args == ["--memory", "x"]  # after --, the program's own


@pytest.mark.parametrize(
    ("given", "why"),
    [
        ("lots", "'lots' is not a size"),
        ("-1G", "'-1G' is not a size"),
        ("2X", "'2X' is not a size"),
        ("1M", "'1M' is 1 MiB: give 0 (what each agent offers) or 16 MiB to 1 PiB"),
        ("2P", "'2P' is 2 PiB: give 0"),
    ],
)
def test_a_bad_memory_is_a_usage_error(coord: Any, app: Path, given: str, why: str) -> None:
    res = run("submit", str(app), "-n", "2", "--memory", given)
    assert res.exit_code == 2, res.output
    assert "Invalid value for '--memory'" in res.stderr and why in res.stderr
    assert coord.jobs == {} and coord.requests == []  # refused before anything was sent


def test_status_shows_memory_and_unsandboxed(coord: Any, app: Path) -> None:
    run("submit", str(app), "-n", "2")
    run("submit", str(app), "-n", "2", "--memory", "2G", "--allow-unsandboxed")
    first = run("status", "1").stdout.splitlines()[0]
    assert first == "job 1  'app.py'  user alice  2 ranks"
    first = run("status", "2").stdout.splitlines()[0]
    assert first == (
        "job 2  'app.py'  user alice  2 ranks  (2 GiB per rank)  (unsandboxed agents allowed)"
    )
    detail = json.loads(run("status", "2", "--json").stdout)
    assert (detail["job"]["memory"], detail["job"]["unsandboxed"]) == (2 * GiB, True)


AGENTS = [
    AgentInfo(
        id="agent-1",
        name="lab-pc",
        state="alive",
        slots=4,
        ranks=2,
        last_seen=1000.0,
        isolation="sandbox",
        rank_memory=2 * GiB,
        checkpoints=True,
    ),
    AgentInfo(
        id="agent-2",
        name="laptop",
        state="alive",
        slots=2,
        ranks=0,
        last_seen=1000.0,
        isolation="sandbox-rlimits",
        isolation_detail="no cgroup:\n  rlimits only",
        rank_memory=0,
    ),
    AgentInfo(
        id="agent-3",
        name="old-box",
        state="lost",
        slots=8,
        ranks=0,
        last_seen=900.0,
        isolation="none",
        isolation_detail="bwrap missing",
        rank_memory=512 * MiB,
        integrity_failures=2,
    ),
    AgentInfo(id="agent-4", name="new", state="alive", slots=1, ranks=0, last_seen=1000.0),
]


def test_status_without_a_job_lists_the_agents(coord: Any) -> None:
    coord.agents = AGENTS
    res = run("status")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0] == "pool 'fake' (vpool 0.1.0): 0 agents and 0 relays alive"
    header = lines[2].split()
    assert header[:4] == ["AGENT", "STATE", "RANKS", "SLOTS"]
    col = lines[2].index("ISOLATION")
    mem = lines[2].index("RANK MEMORY")
    detail = lines[2].index("DETAIL")
    rows = {line.split()[0]: line for line in lines[3:7]}
    assert [rows[n][col:mem].strip() for n in ("lab-pc", "laptop", "old-box", "new")] == [
        "sandbox",
        "sandbox-rlimits",
        "none",
        "not reported",
    ]
    assert [rows[n][mem:].split("  ")[0] for n in ("lab-pc", "laptop", "old-box", "new")] == [
        "2 GiB",
        "no limit",
        "512 MiB",
        "-",
    ]
    assert rows["laptop"][detail:] == "no cgroup: rlimits only"  # one line
    assert rows["lab-pc"][detail:] == "-"
    assert rows["old-box"][detail:] == "bwrap missing; 2 sealed messages did not open here"
    assert "agents that have not reported their isolation get no ranks" in res.stdout
    assert "--allow-unsandboxed" in res.stdout

    data = json.loads(run("status", "--json").stdout)
    assert data["pool"]["name"] == "fake"
    assert [(a["name"], a["isolation"], a["rank_memory"]) for a in data["agents"]] == [
        ("lab-pc", "sandbox", 2 * GiB),
        ("laptop", "sandbox-rlimits", 0),
        ("old-box", "none", 512 * MiB),
        ("new", "", 0),
    ]


def test_status_without_a_job_shows_what_each_volunteer_lets_its_agent_do(coord: Any) -> None:
    base = AgentInfo(id="", name="", state="alive", slots=2, ranks=0, last_seen=1000.0)
    coord.agents = [
        msgspec.structs.replace(base, name="idle"),
        msgspec.structs.replace(base, name="full", ranks=2, activity="busy"),
        msgspec.structs.replace(
            base,
            name="away",
            activity="suspended",
            activity_reason="the owner is\nusing the machine",
        ),
        msgspec.structs.replace(base, name="bye", activity="leaving"),
        msgspec.structs.replace(base, name="left", state="gone", activity="leaving"),
        msgspec.structs.replace(base, name="dead", state="lost"),
    ]
    res = run("status")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    col, end = lines[2].index("ACTIVITY"), lines[2].index("ISOLATION")
    rows = {line.split()[0]: line for line in lines[3:9]}
    assert {n: (r.split()[1], r[col:end].strip()) for n, r in rows.items()} == {
        "idle": ("alive", "available"),
        "full": ("alive", "busy"),
        "away": ("alive", "suspended: the owner is using the machine"),
        "bye": ("alive", "leaving"),
        "left": ("gone", "-"),
        "dead": ("lost", "-"),
    }
    assert "suspended and leaving agents get no new ranks" in res.stdout
    data = json.loads(run("status", "--json").stdout)
    assert [(a["activity"], a["activity_reason"]) for a in data["agents"]][2] == (
        "suspended",
        "the owner is\nusing the machine",
    )


def test_status_of_a_job_marks_suspended_ranks(coord: Any, app: Path) -> None:
    coord.script(state="running", exit_code=None, suspended={1: 1002.0})
    run("submit", str(app), "-n", "2")
    res = run("status", "1")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("RANK"))
    col = lines[head].index("STATE")
    assert lines[head + 1][col:].split("  ")[0] == "exited"
    assert lines[head + 2][col:].split("  ")[0] == "running (suspended)"


def test_status_of_a_pool_without_agents(coord: Any) -> None:
    res = run("status")
    assert res.exit_code == 0, res.output
    assert "no agent has enrolled yet" in res.stderr
    assert json.loads(run("status", "--json").stdout)["agents"] == []


def test_client_passes_memory_and_lists_agents(coord: Any, app: Path) -> None:
    coord.agents = AGENTS[:1]
    with coord.client() as client:
        client.submit(app, 1, memory=GiB, unsandboxed=True)
        assert client.agents() == AGENTS[:1]
    assert (coord.jobs[1].submit.memory, coord.jobs[1].submit.unsandboxed) == (GiB, True)
