"""Fault tolerance on the agent's rank side: a rank killed from outside is lost (not failed), a
rank leased again runs as a fresh incarnation, and a coordinator outage loses nothing."""

from __future__ import annotations

import json
import os
import signal
import textwrap
from pathlib import Path

import msgspec

from vpool.protocol import api
from vpool.protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    Attach,
    Attached,
    Credit,
    Data,
    Detach,
    Hello,
    Welcome,
)
from vpool.worker_agent.settings import AgentSettings

from .conftest import (
    ENV_PROGRAM,
    FakeCoordinator,
    FakeRelay,
    RunningAgent,
    host_pid,
    lease_for,
    lines,
)

# Prints that it started, then waits until the file named by its argument exists.
WAIT_FOR_FILE = textwrap.dedent(
    """
    import os, sys, time
    print("started", os.getpid(), flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.02)
    print("done", flush=True)
    """
)


async def test_rank_killed_from_outside_is_lost(
    agent: RunningAgent, coordinator: FakeCoordinator
) -> None:
    coordinator.add_lease(lease_for(coordinator, None, args=["hang"]))
    [info] = await coordinator.wait_for(
        lambda: [x for x in lines(coordinator.output_of(7, 0)) if "pid" in x]
    )
    os.kill(host_pid(info["pid"], 7, 0), signal.SIGKILL)
    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert (done.code, done.lost, done.aborted) == (-signal.SIGKILL, True, False)
    assert done.message == "killed by SIGKILL, not by the agent"
    assert coordinator.problems == []


async def test_program_error_and_agent_kill_are_not_lost(
    agent: RunningAgent, coordinator: FakeCoordinator
) -> None:
    coordinator.add_lease(lease_for(coordinator, None, program="import sys; sys.exit(3)"))
    coordinator.add_lease(lease_for(coordinator, None, args=["hang"], rank=1))
    error = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert (error.code, error.lost) == (3, False)
    await coordinator.wait_for(lambda: b"pid" in coordinator.output_of(7, 1))
    coordinator.stop(7, 1, reason="job 7 cancelled")
    stopped = await coordinator.wait_for(lambda: coordinator.exit_of(7, 1))
    assert (stopped.code, stopped.lost) == (128 + signal.SIGKILL, False)
    assert stopped.message == "stopped: job 7 cancelled"


async def test_next_incarnation_gets_a_fresh_secret_and_directory(
    agent: RunningAgent, coordinator: FakeCoordinator
) -> None:
    first = lease_for(coordinator, None, program=ENV_PROGRAM, extra={"data/input.txt": ""})
    coordinator.add_lease(first)
    await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    coordinator.add_lease(msgspec.structs.replace(first, incarnation=2, token="rank-token-7-0-2"))
    await coordinator.wait_for(lambda: any(e.incarnation == 2 for e in coordinator.exits))
    env1, env2 = (
        json.loads(coordinator.output_of(7, 0, incarnation=i).splitlines()[0]) for i in (1, 2)
    )
    assert (env1["VPOOL_INCARNATION"], env2["VPOOL_INCARNATION"]) == ("1", "2")
    assert env1["secret"] != env2["secret"]
    assert env2["fresh"] and Path(env2["cwd"]).name == "work"
    assert env2["PYTHONHASHSEED"] == "0"
    assert all(e.code == 0 for e in coordinator.exits)


async def test_next_incarnation_takes_over_the_relay_attachment(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay
) -> None:
    first = lease_for(coordinator, relay, args=["wait"])
    coordinator.add_lease(first)
    conn = await relay.accept()
    hello, _, _ = await conn.receive()
    assert isinstance(hello, Hello)
    await conn.send(Welcome(version=PROTOCOL_VERSION, relay="relay-0", max_payload=1 << 30))
    await conn.receive()
    await conn.send(Attached(job=7, rank=0, incarnation=1))
    await coordinator.wait_for(lambda: b"welcome" in coordinator.output_of(7, 0))

    # Incarnation 2 of the same rank comes to this agent: incarnation 1 is stopped.
    second = msgspec.structs.replace(first, incarnation=2, args=["proxy", "1"])
    coordinator.add_lease(second)
    before: list[object] = []
    while not isinstance(msg := (await conn.receive())[0], Attach):
        before.append(msg)  # incarnation 1 may end (and detach) before 2 attaches
    assert before in ([], [Detach(job=7, rank=0)])
    await conn.send(Attached(job=7, rank=0, incarnation=2))
    data, _, _ = await conn.receive()
    assert data == Data(job=7, src=0, dst=1, seq=1, ctx=0, tag=5)
    await conn.send(Data(job=7, src=1, dst=0, seq=1, ctx=0, tag=0), b"x")
    await conn.send(Ack(job=7, src=0, dst=1, seq=1))
    after = [(await conn.receive())[0] for _ in range(2)]
    # Incarnation 1 ending does not detach incarnation 2: one Detach, at the very end.
    assert isinstance(after[0], Credit) and after[1] == Detach(job=7, rank=0)
    done = await coordinator.wait_for(
        lambda: next((e for e in coordinator.exits if e.incarnation == 2), None)
    )
    assert done.code == 0
    old = next(e for e in coordinator.exits if e.incarnation == 1)
    assert old.message == "stopped: replaced by incarnation 2" and not old.lost
    assert lines(coordinator.output_of(7, 0, incarnation=2))[0]["welcome"][3] == 2


async def test_coordinator_outage_loses_nothing(
    agent: RunningAgent, coordinator: FakeCoordinator, settings: AgentSettings
) -> None:
    # The rank sees only its own directory: the file it waits for goes there.
    coordinator.add_lease(lease_for(coordinator, None, program=WAIT_FOR_FILE, args=["go"]))
    await coordinator.wait_for(lambda: b"started" in coordinator.output_of(7, 0))
    ns_pid = int(coordinator.output_of(7, 0).split()[1])
    pid = host_pid(ns_pid, 7, 0)
    [go] = [d / "work" / "go" for d in (settings.work_path / "ranks").iterdir()]

    coordinator.down = True  # the coordinator stops...
    go.touch()  # ...and meanwhile the rank ends (its output and exit wait to be posted)
    refused = coordinator.refused_while_down
    await coordinator.wait_for(
        lambda: (
            not _alive(pid)
            and refused.count("/api/v1/agents/heartbeat") >= 3
            and "/api/v1/agents/output" in refused
        )
    )
    beats = len(coordinator.heartbeats)
    coordinator.down = False  # ...and comes back with the same state

    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert (done.code, done.lost) == (0, False)
    assert coordinator.output_of(7, 0) == f"started {ns_pid}\ndone\n".encode()
    assert coordinator.problems == []
    await coordinator.wait_for(lambda: len(coordinator.heartbeats) > beats + 2)
    assert not agent.finished.is_set()
    assert isinstance(coordinator.heartbeats[-1], api.AgentHeartbeat)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_a_crash_is_the_programs_error_not_a_loss(
    agent: RunningAgent, coordinator: FakeCoordinator
) -> None:
    program = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    coordinator.add_lease(lease_for(coordinator, None, program=program))
    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert (done.code, done.lost, done.message) == (128 + signal.SIGSEGV, False, "crashed: SIGSEGV")
