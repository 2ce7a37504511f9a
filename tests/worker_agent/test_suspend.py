"""The agent's suspension loop (worker_agent/suspend.py) and control socket (control.py), in
process: ranks whose processes are stand-ins that record being frozen, a real Unix socket."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio

from vpool.protocol.api import Lease
from vpool.worker_agent import control
from vpool.worker_agent.local_ranks import LocalRank, LocalRanks
from vpool.worker_agent.manners import Battery, Verdict
from vpool.worker_agent.settings import AgentSettings, load_agent_settings
from vpool.worker_agent.suspend import Suspender


class Frozen:
    """A rank's processes that only remember what was done to them."""

    def __init__(self) -> None:
        self.frozen = False
        self.calls: list[bool] = []

    def freeze(self, frozen: bool) -> str:
        self.frozen = frozen
        self.calls.append(frozen)
        return "test"

    def pids(self) -> list[int]:
        return []


class StoredCheckpoint:
    """A checkpointer whose every checkpoint is stored (or none can be taken: ``why``)."""

    def __init__(self, why: str = "") -> None:
        self.why = why
        self.taking = None
        self.taken = 0

    def unable(self) -> str:
        return self.why

    async def checkpoint_now(self) -> bool:
        self.taken += 1
        return True


def running_rank(job: int, rank: int, ckpt: Any = None) -> LocalRank:
    r = LocalRank(Lease(job, rank, 1, 4, "t", "b", "app.py", [], None, [], [], user="ada"))
    r.state = "running"
    r.process = Frozen()
    r.checkpointer = ckpt
    return r


def settings(tmp_path: Path, **kw: object) -> AgentSettings:
    return load_agent_settings(
        None,
        {
            "power_supply_dir": str(tmp_path / "none"),
            "idle_source": "terminals",
            "work_dir": str(tmp_path / "work"),
            **kw,
        },
    )


def make(tmp_path: Path, *ranks: LocalRank, **kw: object) -> tuple[Suspender, list[int]]:
    table = LocalRanks()
    for r in ranks:
        table.add(r)
    changed: list[int] = []
    return Suspender(settings(tmp_path, **kw), table, lambda: changed.append(1)), changed


async def test_suspended_ranks_freeze_once_and_thaw_when_available(tmp_path: Path) -> None:
    a, b = running_rank(1, 0), running_rank(1, 1)
    s, changed = make(tmp_path, a, b)
    async with trio.open_nursery() as nursery:
        await s.apply(Verdict("suspended", "the owner is using the machine"), nursery)
        await s.apply(Verdict("suspended", "the owner is using the machine"), nursery)
    assert a.process.calls == b.process.calls == [True]  # type: ignore[union-attr]
    assert a.suspended_since is not None and not a.unfrozen.is_set()
    assert s.activity == "suspended" and s.reason == "the owner is using the machine"
    states = {r.rank: r for r in s.ranks.states()}
    assert states[0].state == "suspended" and states[0].suspended_for >= 0
    async with trio.open_nursery() as nursery:
        await s.apply(Verdict("available"), nursery)
    assert a.process.calls == [True, False]  # type: ignore[union-attr]
    assert a.suspended_since is None and a.unfrozen.is_set()
    assert {r.state for r in s.ranks.states()} == {"running"}
    assert changed  # each change was told (a heartbeat now, the lease loop woken)


async def test_a_stopping_agent_thaws_its_ranks_for_their_last_checkpoint(
    tmp_path: Path,
) -> None:
    r = running_rank(1, 0)
    s, _ = make(tmp_path, r)
    async with trio.open_nursery() as nursery:
        await s.apply(Verdict("suspended", "the owner is using the machine"), nursery)
        assert r.suspended_since is not None
        s.stopping = True  # Agent.leave: its checkpoints wait for the thaw
        await s.apply(Verdict("suspended", "the owner is using the machine"), nursery)
    assert r.process.calls == [True, False]  # type: ignore[union-attr]
    assert r.unfrozen.is_set() and s.activity == "leaving"


async def test_a_rank_stopping_or_checkpointing_is_not_frozen(tmp_path: Path) -> None:
    stopping, busy = running_rank(1, 0), running_rank(1, 1, StoredCheckpoint())
    stopping.request_stop("job ended")
    busy.checkpointer.taking = object()  # type: ignore[union-attr]
    s, _ = make(tmp_path, stopping, busy)
    async with trio.open_nursery() as nursery:
        await s.apply(Verdict("suspended", "on battery"), nursery)
    assert stopping.process.calls == busy.process.calls == []  # type: ignore[union-attr]
    busy.checkpointer.taking = None  # type: ignore[union-attr]
    async with trio.open_nursery() as nursery:
        await s.apply(Verdict("suspended", "on battery"), nursery)
    assert busy.process.calls == [True]  # type: ignore[union-attr]


async def test_past_the_limit_a_rank_is_checkpointed_and_handed_back(tmp_path: Path) -> None:
    ckpt = StoredCheckpoint()
    r = running_rank(1, 0, ckpt)
    s, _ = make(tmp_path, r, suspend_limit=30.0)
    assert s.suspend_limit == 30.0
    async with trio.open_nursery() as nursery:
        await s.apply(Verdict("suspended", "paused"), nursery)
        assert r.suspended_since is not None
        r.suspended_since -= 31  # frozen for 31 s
        await s.apply(Verdict("suspended", "paused"), nursery)
    assert ckpt.taken == 1
    assert r.process.calls == [True, False]  # type: ignore[union-attr]  # thawed for it
    assert r.stop_requested.is_set() and r.stop_lost
    assert r.stop_reason == (
        "suspended for more than 30 s: moved to another machine from a checkpoint taken now"
    )
    assert not s.handed_back()  # told to stop, but not ended and reported yet
    r.slot_released = True
    assert s.handed_back()


async def test_evacuation_without_a_checkpoint_says_why(tmp_path: Path) -> None:
    r = running_rank(2, 3, StoredCheckpoint("the job takes no checkpoints"))
    s, _ = make(tmp_path, r)
    async with trio.open_nursery() as nursery:
        await s.apply(
            Verdict("suspended", "b", evacuate="its battery is nearly empty (4%)"), nursery
        )
    assert r.stop_lost and r.stop_reason == (
        "its battery is nearly empty (4%): moved to another machine (no checkpoint now: "
        "the job takes no checkpoints)"
    )


async def test_the_pools_limit_applies_unless_the_volunteer_set_one(tmp_path: Path) -> None:
    s, _ = make(tmp_path)
    assert s.suspend_limit == 600.0
    s.pool_limit = 120.0
    assert s.suspend_limit == 120.0
    mine, _ = make(tmp_path, suspend_limit=45.0)
    mine.pool_limit = 120.0
    assert mine.suspend_limit == 45.0


async def test_the_loop_reads_the_battery_and_a_pause(tmp_path: Path) -> None:
    supplies = tmp_path / "ps" / "BAT0"
    supplies.mkdir(parents=True)
    for k, v in {"type": "Battery", "status": "Discharging", "capacity": "60"}.items():
        (supplies / k).write_text(v)
    r = running_rank(1, 0)
    s, _ = make(tmp_path, r, power_supply_dir=str(tmp_path / "ps"), manners_interval=60.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(s.run)
        await s.next_pass()
        assert s.last_seen is not None and s.last_seen.battery == Battery(True, 60.0)
        assert s.reason == "running on battery, 60% left" and r.process.frozen  # type: ignore[union-attr]
        (supplies / "status").write_text("Charging")
        await s.next_pass()
        assert s.available and not r.process.frozen  # type: ignore[union-attr]
        s.pause()
        await s.next_pass()
        assert s.reason == "paused by its owner (until resumed)"
        st = s.status()
        assert st["paused"] and st["paused_for"] is None
        assert st["ranks"][0]["user"] == "ada" and st["ranks"][0]["state"] == "suspended"
        msgspec.json.encode(st)  # what the control socket sends
        s.resume()
        await s.next_pass()
        assert s.available
        s.stopping = True
        assert s.activity == "leaving" and not s.available
        nursery.cancel_scope.cancel()


# -- the control socket ---------------------------------------------------------------------


class FakeAgent:
    def __init__(self, tmp_path: Path) -> None:
        self.settings = settings(tmp_path)
        self.manners, _ = make(tmp_path)
        self.isolation = None
        self.slots = 2
        self.busy = 0
        self.enrolled = type("E", (), {"agent_id": "agent-1"})()
        self.reloaded = 0

    def reload_preferences(self) -> list[str]:
        self.reloaded += 1
        return ["memory"]


async def _ask(path: Path, data: bytes) -> bytes:
    stream = await trio.open_unix_socket(str(path))
    async with stream:
        await stream.send_all(data)
        got = b""
        while not got.endswith(b"\n"):
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            got += chunk
    return got


@pytest.mark.medium
async def test_control_socket_answers_and_refuses_clearly(tmp_path: Path) -> None:
    agent: Any = FakeAgent(tmp_path)
    path = tmp_path / "c.sock"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(agent.manners.run)
        await nursery.start(control.serve, agent, path)
        assert os.stat(path).st_mode & 0o777 == 0o666
        got = msgspec.json.decode(await _ask(path, b'{"op": "status"}\n'))
        assert got["ok"] and got["status"]["name"] == agent.settings.agent_name
        assert got["status"]["activity"] == "available"
        got = msgspec.json.decode(await _ask(path, b'{"op": "pause", "seconds": 60}\n'))
        assert got["status"]["reason"] == "paused by its owner (for 1 min more)"
        got = msgspec.json.decode(await _ask(path, b'{"op": "reload"}\n'))
        assert got["later"] == ["memory"] and agent.reloaded == 1
        for bad, error in [
            (b'{"op": "rm -rf"}\n', "bad request"),
            (b"not json\n", "bad request"),
            (b'{"op": "pause", "seconds": -5}\n', "cannot pause for -5"),
            (b'{"op": "status", "x": 1}\n', "bad request"),
            (b"x" * 5000, "longer than 4096"),
        ]:
            got = msgspec.json.decode(await _ask(path, bad))
            assert not got["ok"] and error in got["error"], (bad[:20], got)
        # Another agent cannot take the socket while this one answers.
        with pytest.raises(control.ControlError, match="another agent is running"):
            await control.bind(path)
        assert await trio.to_thread.run_sync(control.request, path, "status")
        nursery.cancel_scope.cancel()
    assert not path.exists()  # removed when the agent ends
    with pytest.raises(control.ControlError, match="no agent is running here"):
        control.request(path, "status")


async def test_pause_and_resume_are_for_the_owner_only(tmp_path: Path) -> None:
    agent: Any = FakeAgent(tmp_path)
    allowed = {0, os.getuid()}
    refused = await control.handle(agent, control.ControlRequest("pause"), 4242, allowed)
    assert not refused["ok"] and "you are uid 4242" in refused["error"]
    assert agent.manners.paused_until == 0.0
    seen = await control.handle(agent, control.ControlRequest("status"), 4242, allowed)
    assert seen["ok"]
    assert control._allowed_uids(["root", "no-such-user-here"]) == {0, os.getuid()}


@pytest.mark.medium
def test_a_stale_socket_is_replaced(tmp_path: Path) -> None:
    import socket

    path = tmp_path / "c.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # a socket file nobody listens on: an agent that died
    control._clear(path)
    assert not path.exists()
