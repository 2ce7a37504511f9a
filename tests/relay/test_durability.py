"""The log on disk: out-of-core pushes, a relay restarted on its data_dir (in-process and a
real ``vpool-relay`` killed with SIGKILL), torn tails, deleting finished jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from relay_fakes import DEADLINE, FakeAgent, FakeCoordinator, Pool, start_relay

from vpool.protocol.framing import PREFIX
from vpool.protocol.messages import Attach
from vpool.relay import log as logfiles
from vpool.relay.errors import StorageError

BIN = Path(sys.executable).parent


async def test_out_of_core_frames_come_back_from_disk(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    settings = pool.settings(tmp_path / "relay", memory_budget=0)
    relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    await a.attach(pool, 1, 0, size=2)
    big = os.urandom(3 << 20)
    payloads = [b"small-%d" % i for i in range(1, 50)] + [big]
    for seq, p in enumerate(payloads, 1):
        await a.deposit(1, 0, 1, seq, p)
    await a.acks_until(1, 0, 1, len(payloads))
    assert relay.hub.memory_used == 0
    r = await FakeAgent.connect(pool, relay.addr, "agent-r")
    await r.attach(pool, 1, 1, size=2, home=True)
    got = [await r.next_data() for _ in payloads]
    assert [p for _, p in got] == payloads


async def test_memory_is_released_once_pushed(pool: Pool, relay: object) -> None:
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")  # type: ignore[attr-defined]
    await a.attach(pool, 1, 0, size=2)
    for seq in range(1, 11):
        await a.deposit(1, 0, 1, seq, b"m" * 1000)
    await a.acks_until(1, 0, 1, 10)
    hub = relay.hub  # type: ignore[attr-defined]
    assert hub.memory_used > 10_000
    r = await FakeAgent.connect(pool, relay.addr, "agent-r")  # type: ignore[attr-defined]
    await r.attach(pool, 1, 1, size=2, home=True)
    for _ in range(10):
        await r.next_data()
    assert hub.memory_used == 0


async def test_restart_on_the_same_data_dir(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    settings = pool.settings(tmp_path / "relay", segment_size=4096)
    relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    await a.attach(pool, 1, 0, size=3)
    await a.attach(pool, 1, 1, size=3)
    sent = []
    for seq in range(1, 41):
        for src in (0, 1):
            payload = b"%d-%d-" % (src, seq) + b"z" * 300
            await a.deposit(1, src, 2, seq, payload)
            sent.append((src, seq, payload))
    await a.deposit(1, 0, 1, 1, b"to rank 1")
    await a.acks_until(1, 1, 2, 40)
    await a.acks_until(1, 0, 1, 1)
    await a.aclose()
    await relay.stop()
    assert len(list((tmp_path / "relay" / "jobs" / "1" / "2").glob("*.seg"))) > 1

    relay2 = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    a2 = await FakeAgent.connect(pool, relay2.addr, "agent-a")
    att = await a2.attach(pool, 1, 0, size=3)
    assert att.stored == {1: 1, 2: 40}
    r = await FakeAgent.connect(pool, relay2.addr, "agent-r")
    await r.attach(pool, 1, 2, size=3, home=True)
    got = [await r.next_data() for _ in sent]
    assert [(m.src, m.seq, p) for m, p in got] == sent
    # The sender resends what it was not sure of: dropped and acked, not stored twice.
    await a2.deposit(1, 0, 2, 40, b"0-40-" + b"z" * 300)
    await a2.acks_until(1, 0, 2, 40)
    await a2.deposit(1, 0, 2, 41, b"new")
    msg, payload = await r.next_data()
    assert (msg.seq, payload) == (41, b"new")


def _tear(segment: Path, garbage: bytes) -> None:
    with segment.open("ab") as f:
        f.write(garbage)


@pytest.mark.large
async def test_sigkilled_relay_process_restarts_from_its_log(
    pool: Pool, tmp_path: Path, agents: object
) -> None:
    data_dir = tmp_path / "relay"
    ready = tmp_path / "ready.json"
    env = {
        **os.environ,
        "VPOOL_RELAY_TLS_CERT": str(pool.cert),
        "VPOOL_RELAY_TLS_KEY": str(pool.cert_key),
        "VPOOL_RELAY_SIGNING_KEY": pool.public_key_text,
        "VPOOL_RELAY_LOST_GRACE": "30",
    }
    cmd = [
        str(BIN / "vpool-relay"),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--name",
        "r-kill",
        "--data-dir",
        str(data_dir),
        "--ready-file",
        str(ready),
    ]

    async def start() -> tuple[trio.Process, tuple[str, int]]:
        ready.unlink(missing_ok=True)
        proc = await trio.lowlevel.open_process(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        with trio.fail_after(DEADLINE):
            while not ready.exists():
                if proc.poll() is not None:
                    out = await proc.stdout.receive_some(1 << 20) if proc.stdout else b""
                    raise AssertionError(f"relay exited: {out.decode(errors='replace')}")
                await trio.sleep(0.02)
        info = json.loads(ready.read_text())
        assert info["pid"] == proc.pid and info["name"] == "r-kill"
        return proc, (info["host"], info["port"])

    proc, addr = await start()
    try:
        a = await FakeAgent.connect(pool, addr, "agent-a")
        await a.attach(pool, 3, 0, size=2)
        payloads = [os.urandom(100 + 37 * i) for i in range(60)]
        for seq, p in enumerate(payloads, 1):
            await a.deposit(3, 0, 1, seq, p)
        await a.acks_until(3, 0, 1, len(payloads))
        proc.kill()
        with trio.fail_after(DEADLINE):
            await proc.wait()
        assert proc.returncode == -signal.SIGKILL
        await a.aclose()
        # A record torn by the kill: a prefix promising more bytes than were written.
        (segment,) = (data_dir / "jobs" / "3" / "1").glob("*.seg")
        good_size = segment.stat().st_size
        _tear(segment, PREFIX.pack(40, 1000) + b"\x95\x01" * 10)

        proc, addr = await start()
        assert segment.stat().st_size == good_size
        r = await FakeAgent.connect(pool, addr, "agent-r")
        await r.attach(pool, 3, 1, size=2, home=True)
        got = [await r.next_data() for _ in payloads]
        assert [p for _, p in got] == payloads
        assert [m.seq for m, _ in got] == list(range(1, 61))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            with trio.fail_after(DEADLINE):
                await proc.wait()
            output = await proc.stdout.receive_some(1 << 20) if proc.stdout else b""
            assert proc.returncode == 0, output.decode(errors="replace")


async def test_finished_jobs_are_deleted(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    coord = FakeCoordinator(pool)
    settings = pool.settings(tmp_path / "relay", coordinator_url="http://coord", relay_key="s3cret")
    relay = await start_relay(nursery, settings, coordinator_transport=coord.transport)
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    await a.attach(pool, 5, 0, size=2, home=True)
    await a.attach(pool, 6, 0, size=2)
    await a.deposit(5, 0, 1, 1, b"five")
    await a.deposit(6, 0, 1, 1, b"six")
    await a.acks_until(6, 0, 1, 1)
    jobs = tmp_path / "relay" / "jobs"
    assert sorted(p.name for p in jobs.iterdir()) == ["5", "6"]
    coord.finished_jobs = [5]
    seen = len(coord.heartbeats)
    # The heartbeat after the one that said "finished" starts after the deletion was done.
    await coord.wait_for(lambda: len(coord.heartbeats) >= seen + 2)
    assert sorted(p.name for p in jobs.iterdir()) == ["6"]
    msg, _ = await a.recv()
    assert type(msg).__name__ == "Stop" and (msg.job, msg.rank) == (5, 0)  # type: ignore[attr-defined]
    load = coord.heartbeats[-1].load
    assert (load.messages_stored, load.connections) == (1, 1)


async def test_fencing_survives_a_restart(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    settings = pool.settings(tmp_path / "relay")
    relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    a = await FakeAgent.connect(pool, relay.addr, "agent-new")
    await a.attach(pool, 1, 0, size=2, home=True, incarnation=3)
    await a.aclose()
    await relay.stop()

    relay2 = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    old = await FakeAgent.connect(pool, relay2.addr, "agent-old")
    token = pool.rank_token(1, 0, agent="agent-old", size=2, incarnation=2)
    await old.send(Attach(token=token, home=True))
    err = await old.expect_rank_error("fenced")
    assert "incarnation 3" in err.message
    new = await FakeAgent.connect(pool, relay2.addr, "agent-new")
    await new.attach(pool, 1, 0, size=2, home=True, incarnation=3)


async def test_a_log_that_cannot_be_written_stops_the_relay(
    pool: Pool, tmp_path: Path, agents: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(*args: object, **kwargs: object) -> None:
        raise StorageError("cannot write the message log: No space left on device")

    monkeypatch.setattr(logfiles, "write_runs", disk_full)
    settings = pool.settings(tmp_path / "relay")
    with pytest.raises(BaseExceptionGroup) as info, trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
            a = await FakeAgent.connect(pool, relay.addr, "agent-a")
            await a.attach(pool, 1, 0, size=2)
            await a.deposit(1, 0, 1, 1, b"nowhere to go")
            await trio.sleep_forever()
    assert info.group_contains(StorageError, depth=None)


async def test_one_connection_holds_only_its_share_of_the_memory_cache(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    """A flood nobody receives keeps at most connection_memory in memory; another agent's
    frames are still kept in memory, and everything comes back (from disk or memory)."""
    settings = pool.settings(tmp_path / "relay", memory_budget=1 << 20, connection_memory=40_000)
    relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    hub = relay.hub
    flood = await FakeAgent.connect(pool, relay.addr, "agent-flood")
    await flood.attach(pool, 1, 0, size=2)
    for seq in range(1, 101):
        await flood.deposit(1, 0, 1, seq, b"f" * 1000)
    await flood.acks_until(1, 0, 1, 100)
    assert 30_000 < hub.memory_used <= 40_000
    other = await FakeAgent.connect(pool, relay.addr, "agent-other")
    await other.attach(pool, 2, 0, size=2)
    for seq in range(1, 11):
        await other.deposit(2, 0, 1, seq, b"o" * 1000)
    await other.acks_until(2, 0, 1, 10)
    assert hub.memory_used > 40_000  # the other connection's frames stayed in memory
    r = await FakeAgent.connect(pool, relay.addr, "agent-r")
    await r.attach(pool, 1, 1, size=2, home=True)
    got = [await r.next_data() for _ in range(100)]
    assert all(p == b"f" * 1000 for _, p in got)
    await r.attach(pool, 2, 1, size=2, home=True)
    got = [await r.next_data() for _ in range(10)]
    assert all(p == b"o" * 1000 for _, p in got)
    assert hub.memory_used == 0
