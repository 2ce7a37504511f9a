"""The determinant log at a rank's home relay: logged and acknowledged at once, duplicates,
gaps, refused senders, replay on a home attach (before any message), rebuilt after a restart."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.testing
from relay_fakes import DEADLINE, FakeAgent, Pool, RunningRelay, hold_log_writes, start_relay

from vpool.protocol.framing import PREFIX
from vpool.protocol.messages import Ack, Attach, Attached, Data, Det, DetAck, Stop
from vpool.relay import connection


async def test_det_is_logged_and_acked_at_once(
    pool: Pool, relay: RunningRelay, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Acks wait ACK_DELAY for company; a DetAck must not (the rank's next deposit waits for it).
    monkeypatch.setattr(connection, "ACK_DELAY", 3600.0)
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    att, dets = await a.attach_home(pool, 1, 0, size=2)
    assert (att.dets, dets) == (0, [])
    await a.deposit(1, 0, 1, 1, b"m1")  # its Ack now waits for an hour
    for index in range(3):
        await a.det(1, 0, index, b"d%d" % index)
        with trio.fail_after(DEADLINE / 2):
            ack = await a.det_ack()
        assert (ack.job, ack.rank, ack.count) == (1, 0, index + 1)
    box = relay.hub.boxes[(1, 0)]
    assert [d.data for d in box.dets.replay(0)] == [b"d0", b"d1", b"d2"]
    path = Path(relay.settings.data_dir) / "jobs" / "1" / "0" / "dets.log"
    assert path.stat().st_size > 0


async def test_duplicate_det_is_dropped_and_acked_again(pool: Pool, relay: RunningRelay) -> None:
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    await a.attach_home(pool, 1, 0, size=2)
    await a.det(1, 0, 0, b"first")
    await a.det(1, 0, 1, b"second")
    assert (await a.det_ack()).count == 1
    assert (await a.det_ack()).count == 2
    await a.det(1, 0, 0, b"first again")
    assert (await a.det_ack()).count == 2
    assert len(relay.hub.boxes[(1, 0)].dets) == 2


async def test_det_gap_is_a_protocol_error(pool: Pool, relay: RunningRelay) -> None:
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    await a.attach_home(pool, 1, 0, size=2)
    await a.det(1, 0, 0, b"zero")
    await a.det(1, 0, 2, b"two")
    err = await a.expect_error("det_gap")
    assert (err.job, err.rank) == (1, 0)


async def test_det_of_a_rank_not_attached_home_is_refused(pool: Pool, relay: RunningRelay) -> None:
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    await a.attach(pool, 1, 0, size=2)
    await a.det(1, 0, 0, b"not home")
    err = await a.expect_error("not_home")
    assert (err.job, err.rank) == (1, 0) and "home" in err.message
    b = await FakeAgent.connect(pool, relay.addr, "agent-b")
    await b.det(1, 1, 0, b"stranger")
    err = await b.expect_error("not_attached")
    assert (err.job, err.rank) == (1, 1)


async def test_home_attach_replays_dets_before_messages(pool: Pool, relay: RunningRelay) -> None:
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    await a.attach_home(pool, 1, 0, size=2)
    for index in range(5):
        await a.det(1, 0, index, b"d%d" % index)
    while (await a.det_ack()).count < 5:
        pass
    s = await FakeAgent.connect(pool, relay.addr, "agent-s")
    await s.attach(pool, 1, 1, size=2)
    for seq in (1, 2, 3):
        await s.deposit(1, 1, 0, seq, b"m%d" % seq)
    await s.acks_until(1, 1, 0, 3)
    await a.aclose()

    # The agent reconnects: it had forwarded 3 determinants and received message 1.
    b = await FakeAgent.connect(pool, relay.addr, "agent-a")
    att, dets = await b.attach_home(pool, 1, 0, size=2, received={1: 1}, dets_from=3)
    assert att.dets == 5
    assert [(d.index, d.data) for d in dets] == [(3, b"d3"), (4, b"d4")]
    assert [(await b.next_data())[1] for _ in range(2)] == [b"m2", b"m3"]


async def test_restarted_incarnation_gets_every_det_then_every_message(
    pool: Pool, relay: RunningRelay
) -> None:
    old = await FakeAgent.connect(pool, relay.addr, "agent-old")
    await old.attach_home(pool, 1, 0, size=2)
    s = await FakeAgent.connect(pool, relay.addr, "agent-s")
    await s.attach(pool, 1, 1, size=2)
    for seq in (1, 2):
        await s.deposit(1, 1, 0, seq, b"m%d" % seq)
    await old.det(1, 0, 0, b"src=1")
    await old.det(1, 0, 1, b"test=false")
    got, last = [], 0
    while len(got) < 2 or last < 2:
        msg, _ = await old.recv()
        if isinstance(msg, Data):
            got.append(msg.seq)
        elif isinstance(msg, DetAck):
            last = msg.count

    new = await FakeAgent.connect(pool, relay.addr, "agent-new")
    att, dets = await new.attach_home(pool, 1, 0, size=2, incarnation=2)
    assert (att.incarnation, att.dets) == (2, 2)
    assert [d.data for d in dets] == [b"src=1", b"test=false"]
    # Only now the messages, from the start.
    assert [(await new.next_data())[1] for _ in range(2)] == [b"m1", b"m2"]
    # The old incarnation is stopped; its late determinants are dropped.
    stop = await old.expect(Stop)
    assert (stop.rank, stop.incarnation) == (0, 1)
    await old.det(1, 0, 2, b"stale")
    # The new one goes on logging after the replayed ones.
    await new.det(1, 0, 2, b"live")
    assert (await new.det_ack()).count == 3
    assert [d.data for d in relay.hub.boxes[(1, 0)].dets.replay(2)] == [b"live"]


async def test_replaying_sender_is_acked_only_for_what_it_resent(
    pool: Pool, relay: RunningRelay
) -> None:
    old = await FakeAgent.connect(pool, relay.addr, "agent-old")
    await old.attach(pool, 1, 0, size=2)
    for seq in range(1, 6):
        await old.deposit(1, 0, 1, seq, b"m%d" % seq)
    await old.acks_until(1, 0, 1, 5)
    new = await FakeAgent.connect(pool, relay.addr, "agent-new")
    att = await new.attach(pool, 1, 0, size=2, incarnation=2)
    assert att.stored == {1: 5}
    for seq in (1, 2):
        await new.deposit(1, 0, 1, seq, b"m%d" % seq)
    ack = await new.expect(Ack)
    assert ack.seq == 2  # not 5: it has not re-sent 3..5 yet
    for seq in (3, 4, 5, 6):
        await new.deposit(1, 0, 1, seq, b"m%d" % seq)
    await new.acks_until(1, 0, 1, 6)
    r = await FakeAgent.connect(pool, relay.addr, "agent-r")
    await r.attach(pool, 1, 1, size=2, home=True)
    assert [(await r.next_data())[1] for _ in range(6)] == [b"m%d" % i for i in range(1, 7)]


async def test_det_log_is_rebuilt_after_a_restart(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    settings = pool.settings(tmp_path / "relay")
    relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    await a.attach_home(pool, 2, 1, size=3)
    for index in range(4):
        await a.det(2, 1, index, b"x" * index)
    while (await a.det_ack()).count < 4:
        pass
    await a.aclose()
    await relay.stop()
    path = tmp_path / "relay" / "jobs" / "2" / "1" / "dets.log"
    good = path.stat().st_size
    with path.open("ab") as f:  # a record torn by a crash
        f.write(PREFIX.pack(30, 0) + b"\x94")

    relay2 = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    assert path.stat().st_size == good
    b = await FakeAgent.connect(pool, relay2.addr, "agent-a")
    att, dets = await b.attach_home(pool, 2, 1, size=3)
    assert att.dets == 4
    assert dets == [Det(job=2, rank=1, index=i, data=b"x" * i) for i in range(4)]
    await b.det(2, 1, 4, b"after")
    assert (await b.det_ack()).count == 5


async def test_home_attach_waits_for_dets_being_written(
    pool: Pool,
    nursery: trio.Nursery,
    tmp_path: Path,
    agents: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A new incarnation must be told only durable determinants: one it obeyed and the relay
    # then lost in a crash would leave its replay inconsistent with the log.
    release = hold_log_writes(monkeypatch)
    settings = pool.settings(tmp_path / "relay", fsync=True)  # every write in a thread
    relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    old = await FakeAgent.connect(pool, relay.addr, "agent-old")
    token = pool.rank_token(1, 0, agent="agent-old", size=2)
    await old.send(Attach(token=token, home=True))
    await old.expect(Attached)
    for index in range(3):
        await old.det(1, 0, index, b"d%d" % index)
    new = await FakeAgent.connect(pool, relay.addr, "agent-new")
    token = pool.rank_token(1, 0, agent="agent-new", size=2, incarnation=2)
    await new.send(Attach(token=token, home=True))
    await trio.testing.wait_all_tasks_blocked()
    box = relay.hub.boxes[(1, 0)]
    assert (len(box.dets), box.dets.durable) == (3, 0)
    assert box.io.settled is not None  # the Attach waits
    release.set()
    att = await new.expect(Attached)
    assert (att.incarnation, att.dets, box.dets.durable) == (2, 3, 3)
    assert [(await new.expect(Det)).index for _ in range(3)] == [0, 1, 2]
