"""Fault tolerance on the agent's relay side, against the fake relay: determinants both ways,
replay counts, and a relay connection that drops and comes back (re-attach, resend)."""

from __future__ import annotations

import dataclasses

import pytest

from vpool.protocol.errors import ErrorCode
from vpool.protocol.framing import encode_frame
from vpool.protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    Attach,
    Attached,
    Credit,
    Data,
    Delivered,
    Det,
    Detach,
    DetAck,
    Error,
    Hello,
    Welcome,
)
from vpool.worker_agent.settings import AgentSettings

from .conftest import FakeCoordinator, FakeRelay, RelayConn, RunningAgent, lease_for, lines
from .ft_programs import FT_PROGRAM


@pytest.fixture
def settings(settings: AgentSettings) -> AgentSettings:
    return dataclasses.replace(settings, relay_reconnect=20.0)


async def _open(relay: FakeRelay) -> RelayConn:
    conn = await relay.accept()
    hello, _, _ = await conn.receive()
    assert isinstance(hello, Hello)
    await conn.send(Welcome(version=PROTOCOL_VERSION, relay="relay-0", max_payload=1 << 30))
    return conn


async def test_determinants_both_ways_and_replay_count(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay
) -> None:
    coordinator.add_lease(lease_for(coordinator, relay, program=FT_PROGRAM, args=["det"]))
    conn = await _open(relay)
    attach, _, _ = await conn.receive()
    assert isinstance(attach, Attach)
    assert (attach.home, attach.received, attach.dets_from) == (True, {}, 0)
    # An earlier incarnation logged two determinants: they follow Attached, before the rank
    # even runs, and reach it right after its welcome, which announces them.
    await conn.send(Attached(job=7, rank=0, incarnation=1, stored={1: 4}, dets=2))
    await conn.send(Det(job=7, rank=0, index=0, data=b"d0"))
    await conn.send(Det(job=7, rank=0, index=1, data=b"d1"))

    det, _, raw = await conn.receive()
    assert det == Det(job=7, rank=0, index=2, data=b"live")
    assert raw == encode_frame(det)  # forwarded verbatim
    await conn.send(DetAck(job=7, rank=0, count=3))
    data, payload, _ = await conn.receive()
    assert data == Data(job=7, src=0, dst=1, seq=1, ctx=0, tag=0) and payload == b"after"
    await conn.send(Ack(job=7, src=0, dst=1, seq=1))

    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert done.code == 0
    out = lines(coordinator.output_of(7, 0))
    assert out[:5] == [
        {"welcome": [1, 2], "replay_sent": {"1": 4}},
        {"got": ["Det", 7, 0, 0, "d0"]},
        {"got": ["Det", 7, 0, 1, "d1"]},
        {"got": ["DetAck", 7, 0, 3]},
        {"got": ["Ack", 7, 0, 1, 1]},
    ]
    assert out[5]["got"][:2] == ["Error", "not_yours"]
    assert any(r.replay_dets == 2 for h in coordinator.heartbeats for r in h.ranks if r.rank == 0)
    detach, _, _ = await conn.receive()
    assert detach == Detach(job=7, rank=0)  # the forged Det never reached the relay


async def test_relay_connection_drop_reattaches_and_resends(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay
) -> None:
    coordinator.add_lease(lease_for(coordinator, relay, program=FT_PROGRAM, args=["reconnect"]))
    conn = await _open(relay)
    attach, _, _ = await conn.receive()
    assert isinstance(attach, Attach)
    await conn.send(Attached(job=7, rank=0, incarnation=1))
    sent = [await conn.receive() for _ in range(3)]
    assert [m for m, _, _ in sent] == [
        Data(job=7, src=0, dst=1, seq=1, ctx=0, tag=0),
        Data(job=7, src=0, dst=1, seq=2, ctx=0, tag=0),
        Det(job=7, rank=0, index=0, data=b"d0"),
    ]
    pushed = [
        await conn.send(Data(job=7, src=1, dst=0, seq=s, ctx=0, tag=0), b"p%d" % s) for s in (1, 2)
    ]
    for frame in pushed:
        credit, _, _ = await conn.receive()
        assert credit == Credit(job=7, rank=0, nbytes=len(frame))
    # Only the first message is acknowledged before the relay goes away.
    await conn.send(Ack(job=7, src=0, dst=1, seq=1))
    await conn.close()

    # The agent comes back, resumes after what the rank has, and resends the rest, in order,
    # before the message the rank sent meanwhile.
    conn = await _open(relay)
    attach, _, _ = await conn.receive()
    assert isinstance(attach, Attach)
    # dets_from counts the rank's own determinant too: the relay must not push it back.
    assert (attach.home, attach.received, attach.dets_from) == (True, {1: 2}, 1)
    await conn.send(Attached(job=7, rank=0, incarnation=1, stored={1: 1}, dets=0))
    resent = [await conn.receive() for _ in range(3)]
    assert [raw for _, _, raw in resent[:2]] == [sent[2][2], sent[1][2]]  # Det, then seq 2
    assert resent[2][0] == Data(job=7, src=0, dst=1, seq=3, ctx=0, tag=0)
    await conn.send(DetAck(job=7, rank=0, count=1))
    await conn.send(Ack(job=7, src=0, dst=1, seq=3))
    await conn.send(Data(job=7, src=1, dst=0, seq=3, ctx=0, tag=0), b"p3")
    credit, _, _ = await conn.receive()
    assert isinstance(credit, Credit)
    detach, _, _ = await conn.receive()
    assert detach == Detach(job=7, rank=0)

    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert (done.code, done.lost) == (0, False)
    assert coordinator.problems == []
    got = [x["got"][:5] for x in lines(coordinator.output_of(7, 0)) if "got" in x]
    assert got == [
        ["Data", 7, 1, 0, 1],
        ["Data", 7, 1, 0, 2],
        ["Ack", 7, 0, 1, 1],
        ["DetAck", 7, 0, 1],
        ["Ack", 7, 0, 1, 3],
        ["Data", 7, 1, 0, 3],
    ]


async def test_a_detack_lost_with_the_connection_reaches_the_rank_from_attached(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay
) -> None:
    # The relay wrote the rank's determinant, but its DetAck was lost with the connection: on
    # the re-attachment it says it holds it (Attached.dets), the agent does not resend it, and
    # the rank must still hear that it is durable (else, waiting for the DetAck before its
    # next deposit, it would hang).
    coordinator.add_lease(lease_for(coordinator, relay, program=FT_PROGRAM, args=["reconnect"]))
    conn = await _open(relay)
    attach, _, _ = await conn.receive()
    await conn.send(Attached(job=7, rank=0, incarnation=1))
    sent = [await conn.receive() for _ in range(3)]
    for s in (1, 2):
        await conn.send(Data(job=7, src=1, dst=0, seq=s, ctx=0, tag=0), b"p%d" % s)
        await conn.receive()  # its Credit
    await conn.send(Ack(job=7, src=0, dst=1, seq=1))
    await conn.close()

    conn = await _open(relay)
    attach, _, _ = await conn.receive()
    assert isinstance(attach, Attach) and attach.dets_from == 1
    await conn.send(Attached(job=7, rank=0, incarnation=1, stored={1: 1}, dets=1))
    resent = [await conn.receive() for _ in range(2)]
    assert [raw for _, _, raw in resent[:1]] == [sent[1][2]]  # seq 2 only: no Det
    assert resent[1][0] == Data(job=7, src=0, dst=1, seq=3, ctx=0, tag=0)
    await conn.send(Ack(job=7, src=0, dst=1, seq=3))
    await conn.send(Data(job=7, src=1, dst=0, seq=3, ctx=0, tag=0), b"p3")
    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert (done.code, done.lost) == (0, False)
    got = [x["got"][:5] for x in lines(coordinator.output_of(7, 0)) if "got" in x]
    assert ["DetAck", 7, 0, 1] in got


async def test_a_receiver_of_a_message_its_ended_sender_never_got_logged_is_restarted(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay
) -> None:
    # Rank 0 gives rank 1 (same agent) a message and dies; the relay never acknowledges it
    # and the connection drops: the agent cannot have it logged (an ended rank's frames are
    # not resent), so rank 1, which consumed it, is restarted (reported lost) to take it from
    # the log as rank 0's next incarnation sends it.
    for r in (0, 1):
        coordinator.add_lease(
            lease_for(coordinator, relay, program=FT_PROGRAM, args=["local_then_die"], rank=r)
        )
    conn = await _open(relay)
    for _ in range(2):
        attach, _, _ = await conn.receive()
        assert isinstance(attach, Attach)
        rank = int(attach.token.rsplit("-", 1)[1])  # the fake coordinator's rank-token-7-R
        await conn.send(Attached(job=7, rank=rank, incarnation=1))
    data, payload, _ = await conn.receive()
    assert data == Data(job=7, src=0, dst=1, seq=1, ctx=0, tag=0) and payload == b"early"
    delivered, _, _ = await conn.receive()
    assert delivered == Delivered(job=7, rank=1, incarnation=1, src=0, seq=1)
    got = {"got": ["Data", 7, 0, 1, 1, 0, 0, 0, [], False]}
    await coordinator.wait_for(lambda: got in lines(coordinator.output_of(7, 1)))  # consumed
    await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    await conn.close()  # no Ack: lost with the connection
    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 1))
    assert done.lost is True and "which ended before relay relay-0" in done.message


async def test_frames_wait_while_the_relay_is_away(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay
) -> None:
    # The connection drops before the rank sends anything; its first message is held (the
    # rank keeps running) and goes out on the next connection, after the re-attachment.
    coordinator.add_lease(lease_for(coordinator, relay, program=FT_PROGRAM, args=["reconnect"]))
    conn = await _open(relay)
    await conn.receive()
    await conn.send(Attached(job=7, rank=0, incarnation=1))
    first, _, _ = await conn.receive()
    assert isinstance(first, Data) and first.seq == 1
    await conn.close()
    conn = await _open(relay)
    attach, _, _ = await conn.receive()
    assert isinstance(attach, Attach) and attach.received == {}
    # The relay restarted and kept nothing.
    await conn.send(Attached(job=7, rank=0, incarnation=1, stored={}, dets=0))
    frames = [await conn.receive() for _ in range(3)]
    assert [type(m).__name__ for m, _, _ in frames] == ["Data", "Data", "Det"] or [
        type(m).__name__ for m, _, _ in frames
    ] == ["Det", "Data", "Data"]
    seqs = [m.seq for m, _, _ in frames if isinstance(m, Data)]
    assert seqs == [1, 2]
    assert coordinator.problems == []


@pytest.mark.parametrize("code", [ErrorCode.FENCED, ErrorCode.TRIMMED])
async def test_a_refused_rank_leaves_the_connection_to_the_others(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay, code: ErrorCode
) -> None:
    # Both codes end one rank's attachment only (protocol.errors.SCOPES); "trimmed" used to
    # drop the connection every rank of the agent shares.
    coordinator.add_lease(lease_for(coordinator, relay, args=["wait"], rank=1))
    conn = await _open(relay)
    await conn.receive()
    await conn.send(Error(code=code, message="incarnation 2 holds it", job=7, rank=1))
    [problem] = await coordinator.wait_for(lambda: coordinator.problems)
    assert problem.rank == 1 and f"{code}: incarnation 2 holds it" in problem.message
    assert coordinator.exit_of(7, 1) is None  # never started

    # Rank 0 attaches on the same connection and works as usual.
    coordinator.add_lease(lease_for(coordinator, relay, args=["proxy", "1"], rank=0))
    attach, _, _ = await conn.receive()
    assert isinstance(attach, Attach) and attach.token == "rank-token-7-0"
    await conn.send(Attached(job=7, rank=0, incarnation=1))
    data, _, _ = await conn.receive()
    assert isinstance(data, Data) and data.src == 0
    await conn.send(Data(job=7, src=1, dst=0, seq=1, ctx=0, tag=0), b"x")
    await conn.send(Ack(job=7, src=0, dst=1, seq=1))
    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert done.code == 0
    assert len(coordinator.problems) == 1
