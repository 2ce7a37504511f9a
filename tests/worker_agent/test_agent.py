"""The agent end to end against the fake coordinator: leases, processes, output, reports."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import zipfile
from pathlib import Path

import httpx
import pytest
import trio

from vpool.worker_agent.agent import run_agent
from vpool.worker_agent.proxy import choose_socket_path
from vpool.worker_agent.ranks import shim_dir
from vpool.worker_agent.settings import AgentSettings

from .conftest import (
    AGENT_TOKEN,
    ENV_PROGRAM,
    RANK_PROGRAM,
    FakeCoordinator,
    RunningAgent,
    host_pid,
    lease_for,
    lines,
)


async def test_rank_environment_stdin_output_and_results(
    agent: RunningAgent, coordinator: FakeCoordinator, settings: AgentSettings
) -> None:
    lease = lease_for(
        coordinator,
        None,
        program=ENV_PROGRAM,
        size=3,
        stdin=b"input for rank 0",
        extra={"data/input.txt": "original"},
    )
    coordinator.add_lease(lease)
    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert (done.code, done.aborted, done.message) == (0, False, "")

    stdout = coordinator.output_of(7, 0)
    info = json.loads(stdout.splitlines()[0])
    assert stdout.endswith(b"x" * 200000)
    assert coordinator.output_of(7, 0, "stderr") == b"to stderr\n"
    shim = str(shim_dir())
    assert info["PYTHONPATH"].split(os.pathsep)[0] == shim
    assert info["path0"][1] == shim  # first after the script's own directory
    if (shim_dir() / "mpi4py" / "__init__.py").exists():
        assert info["mpi4py"].startswith(shim)
    # Sandboxed: the agent's socket and the rank's directory at their places inside.
    assert info["VPOOL_AGENT_SOCKET"] == "/vpool/agent.sock"
    assert info["VPOOL_RANK_SECRET_FILE"] == "/vpool/rank/.vpool-secret"
    assert "VPOOL_RANK_SECRET" not in info  # never in an environment
    assert len(info["secret"]) >= 32
    assert (info["VPOOL_JOB"], info["VPOOL_RANK"], info["VPOOL_SIZE"]) == ("7", "0", "3")
    assert info["VPOOL_INCARNATION"] == "1"
    assert (info["PYTHONHASHSEED"], info["PYTHONUNBUFFERED"]) == ("0", "1")
    assert not any(k.startswith("VPOOL_AGENT_") and k != "VPOOL_AGENT_SOCKET" for k in info)
    assert info["stdin"] == "input for rank 0"
    assert info["cwd"] == "/vpool/rank/work"
    # Deleted once the rank ended, before the agent stops listing it in heartbeats.
    seen = len(coordinator.heartbeats)
    await coordinator.wait_for(
        lambda: len(coordinator.heartbeats) > seen and coordinator.heartbeats[-1].ranks == []
    )
    assert list((settings.work_path / "ranks").iterdir()) == []

    with zipfile.ZipFile(io.BytesIO(coordinator.results[(7, 0, 1)])) as zf:
        assert sorted(zf.namelist()) == ["data/input.txt", "result.txt"]
        assert zf.read("data/input.txt") == b"original and changed"

    # Output batches were posted with contiguous offsets (no gap, nothing twice).
    offsets = sorted((c.offset, len(c.data)) for c in coordinator.outputs if c.stream == "stdout")
    pos = 0
    for offset, n in offsets:
        assert offset == pos
        pos += n
    assert pos == len(stdout)


async def test_other_ranks_get_no_stdin(agent: RunningAgent, coordinator: FakeCoordinator) -> None:
    coordinator.add_lease(lease_for(coordinator, None, program=ENV_PROGRAM, rank=1, stdin=b"no"))
    await coordinator.wait_for(lambda: coordinator.exit_of(7, 1))
    assert json.loads(coordinator.output_of(7, 1).splitlines()[0])["stdin"] == ""


async def test_exit_code_and_keep_workdirs(
    nursery: trio.Nursery, coordinator: FakeCoordinator, settings: AgentSettings
) -> None:
    kept = dataclasses.replace(settings, keep_workdirs=True)
    await nursery.start(
        lambda task_status: run_agent(
            kept, transport=httpx.MockTransport(coordinator.handle), task_status=task_status
        )
    )
    coordinator.add_lease(lease_for(coordinator, None, program="import sys; sys.exit(3)"))
    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert done.code == 3
    [rank_dir] = (kept.work_path / "ranks").iterdir()
    assert (rank_dir / "work" / "app.py").exists()


async def test_abort_is_reported(agent: RunningAgent, coordinator: FakeCoordinator) -> None:
    coordinator.add_lease(lease_for(coordinator, None, args=["abort"]))
    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert (done.code, done.aborted, done.message) == (7, True, "giving up")


async def test_stop_order_kills_a_rank_that_ignores_sigterm(
    agent: RunningAgent, coordinator: FakeCoordinator
) -> None:
    coordinator.add_lease(lease_for(coordinator, None, args=["hang"]))
    [info] = await coordinator.wait_for(
        lambda: [x for x in lines(coordinator.output_of(7, 0)) if "pid" in x]
    )
    pid = host_pid(info["pid"], 7, 0)
    running = await coordinator.wait_for(
        lambda: any(r.state == "running" for h in coordinator.heartbeats for r in h.ranks)
    )
    assert running
    coordinator.stop(7, 0, reason="cancelled by the user")
    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert done.code == 128 + 9
    assert done.message == "stopped: cancelled by the user"
    _assert_gone(pid)


async def test_bundle_hash_mismatch_is_a_problem(
    agent: RunningAgent, coordinator: FakeCoordinator
) -> None:
    coordinator.corrupt_blobs = True
    lease = lease_for(coordinator, None, program=RANK_PROGRAM)
    coordinator.add_lease(lease)
    [problem] = await coordinator.wait_for(lambda: coordinator.problems)
    assert (problem.job, problem.rank, problem.incarnation) == (7, 0, 1)
    assert f"blob {lease.bundle} from the coordinator hashes to" in problem.message
    assert coordinator.exits == []


async def test_unsafe_bundle_fails_the_rank_once_not_as_lost(
    agent: RunningAgent, coordinator: FakeCoordinator
) -> None:
    """Every agent would refuse the bundle: the rank exits with 126 and the reason (the job
    fails once), where a problem report would count it lost and start it again."""
    coordinator.add_lease(lease_for(coordinator, None, extra={"../escape.py": "x"}))
    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert (done.code, done.lost) == (126, False)
    assert "'..'" in done.message and done.message.startswith("rank 0 cannot start")
    assert coordinator.problems == []


@pytest.mark.parametrize("settings", [{"disk_keep_free": 1 << 60}], indirect=True)
async def test_no_room_on_the_volunteers_disk_hands_the_rank_back(
    agent: RunningAgent, coordinator: FakeCoordinator, settings: AgentSettings
) -> None:
    """A bundle the volunteer's disk has no room for (beyond what it keeps free) is not
    extracted: the rank is reported lost here, not failed (another agent may have room)."""
    coordinator.add_lease(lease_for(coordinator, None))
    [problem] = await coordinator.wait_for(lambda: coordinator.problems)
    assert (problem.job, problem.rank) == (7, 0)
    assert "no room for its bundle here" in problem.message
    assert problem.failure == ""  # not the job's fault: it runs elsewhere
    assert coordinator.exits == []
    assert not list(settings.rank_root_path.glob("*/work"))  # nothing extracted, nothing left


async def test_heartbeat_reports_ranks_and_refreshes_token(
    agent: RunningAgent, coordinator: FakeCoordinator
) -> None:
    coordinator.token_to_hand_out = "fresh-token"
    await coordinator.wait_for(lambda: any(t == "fresh-token" for _, t in coordinator.auth))
    paths = [p for p, t in coordinator.auth]
    assert coordinator.auth[paths.index("/api/v1/agents/heartbeat")][1] == AGENT_TOKEN
    assert coordinator.heartbeats[0].free_slots == 4


async def test_leases_respect_slots(agent: RunningAgent, coordinator: FakeCoordinator) -> None:
    for rank in range(5):
        coordinator.add_lease(lease_for(coordinator, None, args=["hang"], rank=rank, size=5))
    # The fake hands out all five at once; the agent runs them but then asks for none.
    await coordinator.wait_for(
        lambda: any(len(h.ranks) == 5 and h.free_slots == 0 for h in coordinator.heartbeats)
    )
    # While full it does not ask for more work.
    asked = len(coordinator.lease_requests)
    beats = len(coordinator.heartbeats)
    await coordinator.wait_for(lambda: len(coordinator.heartbeats) >= beats + 3)
    assert len(coordinator.lease_requests) == asked
    assert all(r.free_slots > 0 for r in coordinator.lease_requests)
    for rank in range(5):
        coordinator.stop(7, rank)
    await coordinator.wait_for(lambda: len(coordinator.exits) == 5)
    await coordinator.wait_for(
        lambda: (
            coordinator.lease_requests[-1].free_slots == 4
            and len(coordinator.lease_requests) > asked
        )
    )


async def test_cancelling_the_agent_kills_its_ranks(
    agent: RunningAgent, coordinator: FakeCoordinator
) -> None:
    coordinator.add_lease(lease_for(coordinator, None, args=["hang"]))
    [info] = await coordinator.wait_for(
        lambda: [x for x in lines(coordinator.output_of(7, 0)) if "pid" in x]
    )
    pid = host_pid(info["pid"], 7, 0)
    agent.cancel_scope.cancel()
    with trio.fail_after(10):
        await agent.finished.wait()
    [problem] = coordinator.problems
    assert "agent test-agent is shutting down" in problem.message
    _assert_gone(pid)
    assert not agent.started.socket_path.exists()


def _assert_gone(pid: int) -> None:
    # The agent reaps its ranks, so the pid no longer exists (not even as a zombie).
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return
    raise AssertionError(f"rank process {pid} is still alive")


async def test_reenrolls_when_its_token_is_refused(
    agent: RunningAgent, coordinator: FakeCoordinator
) -> None:
    coordinator.revoked.add(AGENT_TOKEN)
    await coordinator.wait_for(lambda: len(coordinator.enrolls) == 2)
    await coordinator.wait_for(lambda: any(t == "agent-token-2" for _, t in coordinator.auth))
    assert coordinator.enrolls[0].public_key == coordinator.enrolls[1].public_key
    beats = len(coordinator.heartbeats)
    await coordinator.wait_for(lambda: len(coordinator.heartbeats) >= beats + 2)
    assert len(coordinator.enrolls) == 2  # the lease and heartbeat loops enrolled once


async def test_refused_output_is_dropped_not_fatal(
    agent: RunningAgent, coordinator: FakeCoordinator
) -> None:
    coordinator.refuse_output = True
    coordinator.add_lease(lease_for(coordinator, None, program="print('lost')"))
    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert done.code == 0 and coordinator.outputs == []
    assert not agent.finished.is_set()


def test_socket_path_too_long_moves_to_a_private_short_dir(tmp_path: Path) -> None:
    assert choose_socket_path(tmp_path) == tmp_path / "agent.sock"
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    path = choose_socket_path(deep)
    assert len(str(path)) <= 107 and path.name.startswith("agent-")
    assert (path.parent.stat().st_mode & 0o777) == 0o700
    assert choose_socket_path(deep) == path  # stable for one work_dir
    assert choose_socket_path(deep / "other") != path


async def test_a_rank_that_leaves_a_deep_tree_ends_as_it_exited_and_leaves_nothing(
    agent: RunningAgent, coordinator: FakeCoordinator, settings: AgentSettings
) -> None:
    """Issue 35: 1,100 nested directories made the agent's walk raise RecursionError: the
    rank counted as lost, its job burned its restarts and 51 rank directories stayed on the
    agent's disk. Now its results are read and its directory removed however deep."""
    coordinator.add_lease(lease_for(coordinator, None, args=["deeptree"]))
    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0), seconds=60)
    assert (done.code, done.lost) == (0, False), done
    assert {"made": "deep"} in lines(coordinator.output_of(7, 0))
    ranks = settings.rank_root_path
    with trio.fail_after(20):
        while ranks.exists() and any(ranks.iterdir()):  # noqa: ASYNC110 - a directory: no event
            await trio.sleep(0.05)
    assert coordinator.problems == []
