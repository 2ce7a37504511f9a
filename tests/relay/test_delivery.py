"""Deposit -> ack -> push between fake agents: several ranks and jobs, FIFO per channel, flow
control, resuming from counters, duplicates, gaps, fencing, detaching."""

from __future__ import annotations

import trio
from relay_fakes import FakeAgent, Pool, RunningRelay, start_relay

from vpool.protocol.framing import encode_frame
from vpool.protocol.messages import Attach, Credit, Data, Detach, Stop


def frame_size(msg: Data, payload: bytes) -> int:
    return len(encode_frame(msg, payload))


async def test_round_trip_several_ranks_and_jobs(pool: Pool, relay: RunningRelay) -> None:
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    b = await FakeAgent.connect(pool, relay.addr, "agent-b")
    assert a.welcome is not None and a.welcome.relay == "relay-t"
    # job 1: ranks 0, 1 on agent a, rank 2 on agent b; job 2: rank 0 on a, rank 1 on b.
    for job, rank, agent, size in [
        (1, 0, a, 3),
        (1, 1, a, 3),
        (1, 2, b, 3),
        (2, 0, a, 2),
        (2, 1, b, 2),
    ]:
        att = await agent.attach(pool, job, rank, size=size, home=True)
        assert (att.job, att.rank, att.incarnation, att.stored) == (job, rank, 1, {})

    await a.deposit(1, 0, 2, 1, b"j1 0->2")
    await a.deposit(1, 1, 2, 1, b"j1 1->2")
    await a.deposit(2, 0, 1, 1, b"j2 0->1")
    await b.deposit(1, 2, 0, 1, b"j1 2->0")
    await b.deposit(2, 1, 0, 1, b"j2 1->0")

    got_b = {(m.job, m.src, m.dst): p for m, p in [await b.next_data() for _ in range(3)]}
    assert got_b == {(1, 0, 2): b"j1 0->2", (1, 1, 2): b"j1 1->2", (2, 0, 1): b"j2 0->1"}
    got_a = {(m.job, m.src, m.dst): p for m, p in [await a.next_data() for _ in range(2)]}
    assert got_a == {(1, 2, 0): b"j1 2->0", (2, 1, 0): b"j2 1->0"}


async def test_acks_follow_the_log(pool: Pool, relay: RunningRelay) -> None:
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    await a.attach(pool, 1, 0, size=2)
    for seq in range(1, 6):
        await a.deposit(1, 0, 1, seq, b"x" * seq)
    await a.acks_until(1, 0, 1, 5)
    # A reconnecting sender learns what is stored, so it need not resend it.
    a2 = await FakeAgent.connect(pool, relay.addr, "agent-a")
    att = await a2.attach(pool, 1, 0, size=2)
    assert att.stored == {1: 5}


async def test_fifo_per_channel(pool: Pool, relay: RunningRelay) -> None:
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    b = await FakeAgent.connect(pool, relay.addr, "agent-b")
    r = await FakeAgent.connect(pool, relay.addr, "agent-r")
    await a.attach(pool, 1, 0, size=3)
    await b.attach(pool, 1, 1, size=3)
    await r.attach(pool, 1, 2, size=3, home=True)
    n = 200

    async def send(agent: FakeAgent, src: int) -> None:
        for seq in range(1, n + 1):
            await agent.deposit(1, src, 2, seq, f"{src}:{seq}".encode())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send, a, 0)
        nursery.start_soon(send, b, 1)
        last = {0: 0, 1: 0}
        for _ in range(2 * n):
            msg, payload = await r.next_data()
            assert msg.seq == last[msg.src] + 1
            assert payload == f"{msg.src}:{msg.seq}".encode()
            last[msg.src] = msg.seq
    assert last == {0: n, 1: n}


async def test_flow_control_window(
    pool: Pool, nursery: trio.Nursery, tmp_path: object, agents: object
) -> None:
    settings = pool.settings(tmp_path / "relay", push_window=1000)  # type: ignore[operator]
    relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    r = await FakeAgent.connect(pool, relay.addr, "agent-r")
    await a.attach(pool, 1, 0, size=2)
    await r.attach(pool, 1, 1, size=2, home=True)
    payload = b"p" * 250
    for seq in range(1, 11):
        await a.deposit(1, 0, 1, seq, payload)
    await a.acks_until(1, 0, 1, 10)
    size = frame_size(Data(job=1, src=0, dst=1, seq=1, ctx=0, tag=0), payload)
    per_window = -(-1000 // size)  # pushed while fewer than 1000 bytes are outstanding
    got = [await r.next_data(credit=False) for _ in range(per_window)]
    assert [m.seq for m, _ in got] == list(range(1, per_window + 1))
    with trio.move_on_after(0.2) as idle:
        await r.next_data(credit=False)
    assert idle.cancelled_caught, "the relay pushed past the window"
    # Crediting one frame lets exactly one more through.
    await r.send(Credit(job=1, rank=1, nbytes=size))
    msg, _ = await r.next_data(credit=False)
    assert msg.seq == per_window + 1
    await r.send(Credit(job=1, rank=1, nbytes=size * (per_window + 1)))
    rest = [await r.next_data() for _ in range(10 - per_window - 1)]
    assert [m.seq for m, _ in rest] == list(range(per_window + 2, 11))


async def test_frame_larger_than_window_goes_alone(
    pool: Pool, nursery: trio.Nursery, tmp_path: object, agents: object
) -> None:
    settings = pool.settings(tmp_path / "relay", push_window=64 * 1024)  # type: ignore[operator]
    relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    r = await FakeAgent.connect(pool, relay.addr, "agent-r")
    await a.attach(pool, 1, 0, size=2)
    await r.attach(pool, 1, 1, size=2, home=True)
    big = bytes(range(256)) * 4096 * 5  # 5 MiB
    await a.deposit(1, 0, 1, 1, big)
    await a.deposit(1, 0, 1, 2, b"after")
    msg, payload = await r.next_data()
    assert msg.seq == 1 and payload == big
    msg, payload = await r.next_data()
    assert msg.seq == 2 and payload == b"after"


async def test_resume_from_received_counters(pool: Pool, relay: RunningRelay) -> None:
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    r = await FakeAgent.connect(pool, relay.addr, "agent-r")
    await a.attach(pool, 1, 0, size=3)
    await a.attach(pool, 1, 1, size=3)
    await r.attach(pool, 1, 2, size=3, home=True)
    for seq in range(1, 6):
        await a.deposit(1, 0, 2, seq, b"a%d" % seq)
        await a.deposit(1, 1, 2, seq, b"b%d" % seq)
    got = [await r.next_data() for _ in range(10)]
    assert len(got) == 10
    await r.aclose()

    # The rank had consumed 0:3 and 1:5 when its agent's connection dropped.
    r2 = await FakeAgent.connect(pool, relay.addr, "agent-r")
    await r2.attach(pool, 1, 2, size=3, home=True, received={0: 3, 1: 5})
    got2 = [await r2.next_data() for _ in range(2)]
    assert [(m.src, m.seq, p) for m, p in got2] == [(0, 4, b"a4"), (0, 5, b"a5")]
    await a.deposit(1, 1, 2, 6, b"b6")
    msg, payload = await r2.next_data()
    assert (msg.src, msg.seq, payload) == (1, 6, b"b6")


async def test_duplicate_is_dropped_and_acked_again(pool: Pool, relay: RunningRelay) -> None:
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    r = await FakeAgent.connect(pool, relay.addr, "agent-r")
    await a.attach(pool, 1, 0, size=2)
    await r.attach(pool, 1, 1, size=2, home=True)
    for seq in (1, 2, 3):
        await a.deposit(1, 0, 1, seq, b"m%d" % seq)
    await a.acks_until(1, 0, 1, 3)
    await a.deposit(1, 0, 1, 2, b"m2")
    ack = await a.next_ack()
    assert (ack.src, ack.dst, ack.seq) == (0, 1, 3)  # cumulative: covers the duplicate
    await a.deposit(1, 0, 1, 4, b"m4")
    await a.acks_until(1, 0, 1, 4)
    got = [await r.next_data() for _ in range(4)]
    assert [m.seq for m, _ in got] == [1, 2, 3, 4]


async def test_gap_is_a_protocol_error(pool: Pool, relay: RunningRelay) -> None:
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    await a.attach(pool, 1, 0, size=2)
    await a.deposit(1, 0, 1, 1, b"one")
    await a.deposit(1, 0, 1, 3, b"three")
    err = await a.expect_error("seq_gap")
    assert (err.job, err.rank) == (1, 0)


async def test_fencing_by_incarnation(pool: Pool, relay: RunningRelay) -> None:
    old = await FakeAgent.connect(pool, relay.addr, "agent-old")
    await old.attach(pool, 1, 0, size=2, home=True, incarnation=1)
    new = await FakeAgent.connect(pool, relay.addr, "agent-new")
    att = await new.attach(pool, 1, 0, size=2, home=True, incarnation=2)
    assert att.incarnation == 2
    stop = await old.expect(Stop)
    assert (stop.job, stop.rank, stop.incarnation) == (1, 0, 1)
    # The old clone's late deposits are dropped without hurting its connection...
    await old.deposit(1, 0, 1, 1, b"stale")
    # ...and it cannot come back: refused, its frames dropped, but the connection (which may
    # carry the agent's other ranks) stays up.
    token = pool.rank_token(1, 0, agent="agent-old", size=2, incarnation=1)
    await old.send(Attach(token=token, home=True))
    err = await old.expect_rank_error("fenced")
    assert (err.job, err.rank) == (1, 0)
    await old.deposit(1, 0, 1, 1, b"stale")
    await old.det(1, 0, 0, b"stale")
    att1 = await old.attach(pool, 1, 1, size=2)
    assert att1.stored == {}
    # The new incarnation works.
    await new.deposit(1, 0, 1, 1, b"fresh")
    await new.acks_until(1, 0, 1, 1)
    r = await FakeAgent.connect(pool, relay.addr, "agent-r")
    await r.attach(pool, 1, 1, size=2, home=True)
    msg, payload = await r.next_data()
    assert (msg.src, msg.seq, payload) == (0, 1, b"fresh")


async def test_detach_is_not_a_loss(
    pool: Pool, nursery: trio.Nursery, tmp_path: object, agents: object
) -> None:
    from relay_fakes import FakeCoordinator

    coord = FakeCoordinator(pool)
    settings = pool.settings(  # type: ignore[operator]
        tmp_path / "relay", coordinator_url="http://coord", relay_key="s3cret", lost_grace=0.05
    )
    relay = await start_relay(nursery, settings, coordinator_transport=coord.transport)
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")
    await a.attach(pool, 1, 0, size=2, home=True)
    await a.attach(pool, 1, 1, size=2, home=True)
    await a.send(Detach(job=1, rank=0))
    await a.aclose()
    await coord.wait_for(lambda: bool(coord.lost))
    await coord.wait_for(lambda: len(coord.heartbeats) >= 3)
    assert [(x.job, x.rank) for x in coord.lost] == [(1, 1)]
