"""Re-sent messages compared with the logged ones: equal copies are dropped and acked, a
different one means the program is not deterministic (an Error for that rank, one report)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio
from relay_fakes import FakeAgent, FakeCoordinator, Pool, hold_log_writes, start_relay

from vpool.protocol.framing import encode_frame
from vpool.protocol.messages import Data
from vpool.relay import connection
from vpool.relay import hub as hubmod
from vpool.relay.log import digest


async def _relay_with_coordinator(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, **settings_kw: Any
) -> tuple[object, FakeCoordinator]:
    coord = FakeCoordinator(pool)
    settings = pool.settings(
        tmp_path / "relay", coordinator_url="http://coord", relay_key="s3cret", **settings_kw
    )
    relay = await start_relay(nursery, settings, coordinator_transport=coord.transport)
    return relay, coord


async def test_logged_messages_keep_their_digest(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    relay, _ = await _relay_with_coordinator(pool, nursery, tmp_path)
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")  # type: ignore[attr-defined]
    await a.attach(pool, 1, 0, size=2)
    payloads = [b"small", os.urandom(hubmod.DIGEST_INLINE_MAX + 1000)]
    for seq, p in enumerate(payloads, 1):
        await a.deposit(1, 0, 1, seq, p)
    await a.acks_until(1, 0, 1, 2)
    # Re-sending the big one waits for its digest if it is not computed yet: equal, so acked.
    await a.deposit(1, 0, 1, 2, payloads[1])
    await a.acks_until(1, 0, 1, 2)
    # The big digest is computed in a thread after the write; stopping the relay waits for
    # it (shielded: a copy may be waiting for it).
    await relay.stop()  # type: ignore[attr-defined]
    assert not relay.hub.core.waiting  # type: ignore[attr-defined]
    mailbox = relay.hub.boxes[(1, 1)].mailbox  # type: ignore[attr-defined]
    for seq, p in enumerate(payloads, 1):
        frame = encode_frame(Data(job=1, src=0, dst=1, seq=seq, ctx=0, tag=0), p)
        assert mailbox.entry(0, seq).digest == digest(frame)


async def test_different_resend_is_reported_once(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    relay, coord = await _relay_with_coordinator(pool, nursery, tmp_path)
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")  # type: ignore[attr-defined]
    await a.attach(pool, 4, 0, size=3, incarnation=2)
    await a.attach(pool, 4, 1, size=3)
    for seq in (1, 2, 3):
        await a.deposit(4, 0, 2, seq, b"m%d" % seq)
    await a.acks_until(4, 0, 2, 3)
    # Same content: dropped, acked again.
    await a.deposit(4, 0, 2, 2, b"m2")
    await a.acks_until(4, 0, 2, 3)
    # Different content.
    await a.deposit(4, 0, 2, 2, b"M2")
    err = await a.expect_rank_error("not_deterministic")
    assert (err.job, err.rank) == (4, 0)
    message = (
        "program is not deterministic: rank 0 re-sent message 2 to rank 2 (channel 0->2) "
        "with different content"
    )
    assert err.message == message
    # The connection stays up: another rank on it goes on; rank 0's deposits are dropped.
    await a.deposit(4, 0, 2, 3, b"other")
    await a.deposit(4, 0, 2, 4, b"m4")
    await a.deposit(4, 1, 2, 1, b"from 1")
    await a.acks_until(4, 1, 2, 1)
    mailbox = relay.hub.boxes[(4, 2)].mailbox  # type: ignore[attr-defined]
    assert mailbox.stored(0) == 3
    await coord.wait_for(lambda: bool(coord.diverged))
    (report,) = coord.diverged
    assert (report.name, report.job, report.rank, report.incarnation, report.message) == (
        "relay-t",
        4,
        0,
        2,
        message,
    )
    # The agent reconnects and the rank diverges again: the coordinator heard it once.
    await a.aclose()
    b = await FakeAgent.connect(pool, relay.addr, "agent-a")  # type: ignore[attr-defined]
    await b.attach(pool, 4, 0, size=3, incarnation=2)
    await b.deposit(4, 0, 2, 1, b"M1")
    await b.expect_rank_error("not_deterministic")
    seen = len(coord.heartbeats)
    await coord.wait_for(lambda: len(coord.heartbeats) >= seen + 2)
    assert len(coord.diverged) == 1


async def test_big_resend_that_differs_before_its_digest_is_known(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    relay, coord = await _relay_with_coordinator(pool, nursery, tmp_path)
    a = await FakeAgent.connect(pool, relay.addr, "agent-a")  # type: ignore[attr-defined]
    await a.attach(pool, 1, 0, size=2)
    big = bytearray(os.urandom(300_000))
    await a.deposit(1, 0, 1, 1, bytes(big))
    big[-1] ^= 1
    await a.deposit(1, 0, 1, 1, bytes(big))  # one bit flipped, right behind the original
    err = await a.expect_rank_error("not_deterministic")
    assert "re-sent message 1 to rank 1" in err.message
    await coord.wait_for(lambda: bool(coord.diverged))


async def test_dead_incarnations_message_is_not_acked_to_its_successor(
    pool: Pool,
    nursery: trio.Nursery,
    tmp_path: Path,
    agents: object,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Incarnation 1's message is in the log but not yet written when incarnation 2 attaches.
    Written, it must not be acked to incarnation 2: that would tell it its own message 1 is
    logged, so it would never send it and a different copy would never be compared (the
    fault-tolerance model's test_acks_for_a_dead_incarnations_message_hide_nondeterminism)."""
    release = hold_log_writes(monkeypatch)
    acks: list[tuple[str, int, int, int, int]] = []
    real_queue_ack = connection.Connection.queue_ack

    def queue_ack(self: connection.Connection, job: int, src: int, dst: int, seq: int) -> None:
        acks.append((self.agent, job, src, dst, seq))
        real_queue_ack(self, job, src, dst, seq)

    monkeypatch.setattr(connection.Connection, "queue_ack", queue_ack)
    relay, coord = await _relay_with_coordinator(pool, nursery, tmp_path, fsync=True)
    old = await FakeAgent.connect(pool, relay.addr, "agent-old")  # type: ignore[attr-defined]
    await old.attach(pool, 1, 0, size=2)
    await old.deposit(1, 0, 1, 1, b"stamp 1")
    new = await FakeAgent.connect(pool, relay.addr, "agent-new")  # type: ignore[attr-defined]
    await new.attach(pool, 1, 0, size=2, incarnation=2)
    mailbox = relay.hub.boxes[(1, 1)].mailbox  # type: ignore[attr-defined]
    assert (len(mailbox), mailbox.durable_count) == (1, 0)
    release.set()
    receiver = await FakeAgent.connect(pool, relay.addr, "agent-r")  # type: ignore[attr-defined]
    await receiver.attach(pool, 1, 1, size=2, home=True)
    _, payload = await receiver.next_data()  # pushed once durable, after its acks were queued
    assert payload == b"stamp 1"
    assert [a for a in acks if a[0] == "agent-new"] == []
    await new.deposit(1, 0, 1, 1, b"stamp 2")  # so its own copy is compared
    err = await new.expect_rank_error("not_deterministic")
    assert "rank 0 re-sent message 1 to rank 1" in err.message
    await coord.wait_for(lambda: bool(coord.diverged))
    assert [a for a in acks if a[0] == "agent-new"] == []
