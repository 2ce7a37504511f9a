"""Validation by replay at a real relay: a rank re-executed with a ``validating`` token re-sends
over TLS what its original incarnation logged; the relay lets nothing new through and posts
one verdict per incarnation to ``/relays/validated``."""

from __future__ import annotations

from pathlib import Path

import trio
from relay_fakes import FakeAgent, FakeCoordinator, Pool, RunningRelay, start_relay

from vpool.protocol.messages import Detach

JOB, SIZE = 9, 3
ORIGINAL, REPLAY = 1, 2  # incarnations of rank 0


async def _relay(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path
) -> tuple[RunningRelay, FakeCoordinator]:
    coord = FakeCoordinator(pool)
    settings = pool.settings(tmp_path / "relay", coordinator_url="http://coord", relay_key="s3cret")
    relay = await start_relay(nursery, settings, coordinator_transport=coord.transport)
    return relay, coord


async def _original_run(pool: Pool, relay: RunningRelay, count: int) -> None:
    """Rank 0's original incarnation sends ``count`` messages to rank 1, then ends."""
    a = await FakeAgent.connect(pool, relay.addr, "agent-original")
    await a.attach(pool, JOB, 0, size=SIZE, incarnation=ORIGINAL)
    for seq in range(1, count + 1):
        await a.deposit(JOB, 0, 1, seq, b"m%d" % seq)
    await a.acks_until(JOB, 0, 1, count)
    await a.send(Detach(job=JOB, rank=0))
    await a.aclose()


async def _replay(pool: Pool, relay: RunningRelay, incarnation: int = REPLAY) -> FakeAgent:
    v = await FakeAgent.connect(pool, relay.addr, f"agent-validator-{incarnation}")
    await v.attach(pool, JOB, 0, size=SIZE, incarnation=incarnation, validating=True)
    return v


async def test_an_identical_replay_agrees_when_it_detaches(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    relay, coord = await _relay(pool, nursery, tmp_path)
    await _original_run(pool, relay, 3)
    v = await _replay(pool, relay)
    for seq in (1, 2, 3):
        await v.deposit(JOB, 0, 1, seq, b"m%d" % seq)
    await v.acks_until(JOB, 0, 1, 3)  # logged copies are acked as usual
    assert coord.validated == []
    await v.send(Detach(job=JOB, rank=0))
    await coord.wait_for(lambda: bool(coord.validated))
    [report] = coord.validated
    assert (report.name, report.job, report.rank, report.incarnation, report.agreed) == (
        "relay-t",
        JOB,
        0,
        REPLAY,
        True,
    )
    assert coord.diverged == [] and len(relay.hub.boxes[(JOB, 1)].mailbox) == 3


async def test_a_replay_that_differs_disagrees_and_is_not_a_divergence(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    relay, coord = await _relay(pool, nursery, tmp_path)
    await _original_run(pool, relay, 2)
    v = await _replay(pool, relay)
    await v.deposit(JOB, 0, 1, 1, b"m1")
    await v.deposit(JOB, 0, 1, 2, b"forged")
    err = await v.expect_rank_error("not_deterministic")
    assert (err.job, err.rank) == (JOB, 0)
    await coord.wait_for(lambda: bool(coord.validated))
    [report] = coord.validated
    assert (report.incarnation, report.agreed, report.message) == (REPLAY, False, err.message)
    assert "sent message seq 2 to rank 1 with content other than the original" in err.message
    # Posted in the order they came: a divergence would have been posted before the verdict.
    assert coord.diverged == []
    # Its detach gives no second verdict (heartbeats go on meanwhile).
    await v.send(Detach(job=JOB, rank=0))
    seen = len(coord.heartbeats)
    await coord.wait_for(lambda: len(coord.heartbeats) >= seen + 2)
    assert len(coord.validated) == 1


async def test_a_message_the_original_never_sent_is_neither_logged_nor_delivered(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    relay, coord = await _relay(pool, nursery, tmp_path)
    await _original_run(pool, relay, 2)
    receiver = await FakeAgent.connect(pool, relay.addr, "agent-receiver")
    await receiver.attach(pool, JOB, 1, size=SIZE, home=True)
    for seq in (1, 2):
        msg, _ = await receiver.next_data()
        assert (msg.src, msg.seq) == (0, seq)
    v = await _replay(pool, relay)
    for seq in (1, 2, 3):
        await v.deposit(JOB, 0, 1, seq, b"m%d" % seq)
    err = await v.expect_rank_error("not_deterministic")
    assert err.message == (
        "rank 0 re-executed for validation sent message seq 3 to rank 1, which the original "
        "run never sent"
    )
    await coord.wait_for(lambda: bool(coord.validated))
    assert [(r.agreed, r.message) for r in coord.validated] == [(False, err.message)]
    mailbox = relay.hub.boxes[(JOB, 1)].mailbox
    assert (len(mailbox), mailbox.stored(0)) == (2, 2)
    # Nothing reached the receiver: a message of another rank, sent after, is the next push.
    other = await FakeAgent.connect(pool, relay.addr, "agent-other")
    await other.attach(pool, JOB, 2, size=SIZE)
    await other.deposit(JOB, 2, 1, 1, b"from 2")
    msg, payload = await receiver.next_data()
    assert (msg.src, msg.seq, payload) == (2, 1, b"from 2")
    assert relay.hub.pushed_to[(JOB, 1)] == 3


async def test_a_replay_that_ends_early_disagrees_with_the_counts(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    relay, coord = await _relay(pool, nursery, tmp_path)
    await _original_run(pool, relay, 5)
    v = await _replay(pool, relay)
    for seq in (1, 2, 3):
        await v.deposit(JOB, 0, 1, seq, b"m%d" % seq)
    await v.acks_until(JOB, 0, 1, 3)
    await v.send(Detach(job=JOB, rank=0))
    await coord.wait_for(lambda: bool(coord.validated))
    [report] = coord.validated
    assert (report.agreed, report.message) == (
        False,
        "rank 0 re-executed for validation sent 3 messages to rank 1; the original sent 5",
    )


async def test_a_verdict_the_coordinator_refuses_is_dropped_and_the_next_goes_through(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    relay, coord = await _relay(pool, nursery, tmp_path)
    await _original_run(pool, relay, 1)
    coord.validated_status = 404
    v = await _replay(pool, relay)
    await v.send(Detach(job=JOB, rank=0))  # sent nothing: disagrees
    await coord.wait_for(lambda: coord.validated_seen == 1)
    coord.validated_status = 200
    # A second re-execution (a third execution of the rank) is judged and reported on its own.
    w = await _replay(pool, relay, REPLAY + 1)
    await w.deposit(JOB, 0, 1, 1, b"m1")
    await w.acks_until(JOB, 0, 1, 1)
    await w.send(Detach(job=JOB, rank=0))
    await coord.wait_for(lambda: bool(coord.validated))
    assert coord.validated_seen == 2
    assert [(r.incarnation, r.agreed) for r in coord.validated] == [(REPLAY + 1, True)]
