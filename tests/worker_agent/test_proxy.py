"""A real rank process proxied through the agent to a fake TLS relay."""

from __future__ import annotations

import hashlib
import os

import msgspec
import pytest
import trio

from vpool.framestream import FrameStream
from vpool.protocol.framing import encode_frame
from vpool.protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    Attach,
    Attached,
    Credit,
    Data,
    Det,
    Detach,
    Error,
    Hello,
    RankHello,
    Stop,
    Welcome,
)
from vpool.worker_agent import proxy

from .conftest import AGENT_TOKEN, FakeCoordinator, FakeRelay, RelayConn, RunningAgent, lease_for
from .conftest import lines as json_lines


async def _open_relay(relay: FakeRelay) -> RelayConn:
    conn = await relay.accept()
    hello, _, _ = await conn.receive()
    assert isinstance(hello, Hello)
    assert (hello.version, hello.role, hello.token) == (PROTOCOL_VERSION, "agent", AGENT_TOKEN)
    await conn.send(Welcome(version=PROTOCOL_VERSION, relay="relay-0", max_payload=1 << 30))
    return conn


async def _attach(conn: RelayConn, job: int = 7, rank: int = 0) -> Attach:
    attach, _, _ = await conn.receive()
    assert isinstance(attach, Attach)
    assert attach.token == f"rank-token-{job}-{rank}"
    await conn.send(Attached(job=job, rank=rank, incarnation=1))
    return attach


async def _roundtrip(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay, n: int
) -> None:
    coordinator.add_lease(lease_for(coordinator, relay, args=["proxy", str(n)]))
    conn = await _open_relay(relay)
    attach = await _attach(conn)
    assert attach.home is True and attach.received == {}

    # rank -> relay: the frame arrives byte for byte as the rank encoded it
    msg, payload, raw = await conn.receive()
    expected_payload = bytes(range(256)) * n
    assert msg == Data(job=7, src=0, dst=1, seq=1, ctx=0, tag=5)
    assert payload == expected_payload
    assert raw == encode_frame(msg, expected_payload)

    # relay -> rank: pushed Data and an Ack; the agent credits exactly the pushed frame's size
    pushed_payload = os.urandom(256 * n)
    pushed = await conn.send(
        Data(job=7, src=1, dst=0, seq=1, ctx=0, tag=9, kind=1, parts=[len(pushed_payload)]),
        pushed_payload,
    )
    await conn.send(Ack(job=7, src=0, dst=1, seq=1))
    credit, _, _ = await conn.receive()
    assert credit == Credit(job=7, rank=0, nbytes=len(pushed))
    detach, _, _ = await conn.receive()
    assert detach == Detach(job=7, rank=0)

    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert (done.code, done.aborted) == (0, False)
    out = json_lines(coordinator.output_of(7, 0))
    assert out[0]["welcome"][:4] == [7, 0, 2, 1]
    assert {"data": len(pushed_payload), "sha": hashlib.sha256(pushed).hexdigest()} in out
    assert {"other": "Ack", "fields": [7, 0, 1, 1]} in out
    assert coordinator.problems == []


async def test_frames_forwarded_verbatim_both_ways(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay
) -> None:
    await _roundtrip(agent, coordinator, relay, 1)


async def test_large_frames_forwarded_verbatim(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay
) -> None:
    await _roundtrip(agent, coordinator, relay, 8 * 1024)  # 2 MiB each way


async def test_one_connection_per_relay_shared_by_ranks(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay
) -> None:
    for rank in (0, 1):
        coordinator.add_lease(lease_for(coordinator, relay, args=["wait"], rank=rank))
    conn = await _open_relay(relay)
    attached = set()
    for _ in range(2):
        attach, _, _ = await conn.receive()
        assert isinstance(attach, Attach)
        rank = int(attach.token.rsplit("-", 1)[1])
        attached.add(rank)
        await conn.send(Attached(job=7, rank=rank, incarnation=1))
    assert attached == {0, 1}
    # Each rank waits for one frame; a Stop from the relay ends rank 1 only.
    await conn.send(Stop(job=7, rank=1, incarnation=1, reason="fenced by a newer incarnation"))
    stopped = await coordinator.wait_for(lambda: coordinator.exit_of(7, 1))
    assert "fenced by a newer incarnation" in stopped.message
    assert coordinator.exit_of(7, 0) is None
    await conn.send(Data(job=7, src=1, dst=0, seq=1, ctx=0, tag=0), b"hi")
    want = {
        Credit(job=7, rank=0, nbytes=len(encode_frame(Data(7, 1, 0, 1, 0, 0))) + 2),
        Detach(job=7, rank=1),
    }
    while want:
        msg, _, _ = await conn.receive()
        want.discard(msg)  # type: ignore[arg-type]
    await coordinator.wait_for(lambda: b'"got": "Data"' in coordinator.output_of(7, 0))
    with pytest.raises(trio.WouldBlock):
        relay.connections.receive_nowait()  # both ranks used the one connection


async def test_unknown_secret_refused(agent: RunningAgent) -> None:
    async with await trio.open_unix_socket(str(agent.started.socket_path)) as stream:
        await stream.send_all(encode_frame(RankHello(version=PROTOCOL_VERSION, secret="guess")))
        reader = FrameStream(stream)
        with trio.fail_after(5):
            frame = await reader.receive()
            assert frame is not None
            assert isinstance(frame.message, Error) and frame.message.code == "unknown_secret"
            assert await reader.receive() is None  # and the agent closed it


async def test_socket_is_private(agent: RunningAgent) -> None:
    assert (agent.started.socket_path.stat().st_mode & 0o777) == 0o600


async def test_rank_cannot_send_as_another(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay
) -> None:
    coordinator.add_lease(lease_for(coordinator, relay, args=["forged"]))
    conn = await _open_relay(relay)
    await _attach(conn)
    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert done.code == 0
    assert {"refused": "not_yours"} in json_lines(coordinator.output_of(7, 0))
    detach, _, _ = await conn.receive()
    assert detach == Detach(job=7, rank=0)  # and no Data reached the relay before it


async def test_relay_drop_reports_problem_then_stop_order_kills(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay
) -> None:
    coordinator.add_lease(lease_for(coordinator, relay, args=["wait"]))
    conn = await _open_relay(relay)
    await _attach(conn)
    await coordinator.wait_for(lambda: b"welcome" in coordinator.output_of(7, 0))
    await conn.close()
    [problem] = await coordinator.wait_for(lambda: coordinator.problems)
    assert (problem.job, problem.rank, problem.incarnation) == (7, 0, 1)
    assert f"relay relay-0 (127.0.0.1:{relay.port})" in problem.message
    assert "dropped" in problem.message
    coordinator.stop(7, 0, reason="job 7 failed: rank 0 lost")
    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert done.message == "stopped: job 7 failed: rank 0 lost"
    assert len(coordinator.problems) == 1


async def test_attach_refused_reports_problem(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay
) -> None:
    coordinator.add_lease(lease_for(coordinator, relay, args=["wait"]))
    conn = await _open_relay(relay)
    await conn.receive()
    await conn.send(Error(code="expired_token", message="token has expired", job=7, rank=0))
    [problem] = await coordinator.wait_for(lambda: coordinator.problems)
    assert "expired_token" in problem.message and "relay relay-0" in problem.message
    assert coordinator.exit_of(7, 0) is None  # never started


async def test_payload_over_the_relays_limit_is_refused_to_that_rank_only(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay
) -> None:
    coordinator.add_lease(lease_for(coordinator, relay, args=["proxy", "1"]))
    conn = await relay.accept()
    await conn.receive()
    await conn.send(Welcome(version=PROTOCOL_VERSION, relay="relay-0", max_payload=100))
    await _attach(conn)
    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert done.code == 1  # the test program exits when the agent closes its socket
    refused = [x for x in json_lines(coordinator.output_of(7, 0)) if x.get("other") == "Error"]
    assert refused[0]["fields"][0] == "frame_too_large"
    assert "256 bytes is larger than the 100 bytes relay relay-0" in refused[0]["fields"][1]
    msg, _, _ = await conn.receive()
    assert msg == Detach(job=7, rank=0)  # no Data got through; the connection lives on
    assert coordinator.problems == []


@pytest.mark.parametrize("mode", ["seqgap", "detgap"])
async def test_a_gap_ends_the_rank_not_the_shared_relay_connection(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay, mode: str
) -> None:
    """Issue 35: a rank that skips a message seq or a determinant index had the relay close
    the agent's connection, which every rank of the agent shares (again after each
    reconnect). The agent refuses the gap itself: the rank is told, nothing of the gap
    reaches the relay, and the connection carries on."""
    coordinator.add_lease(lease_for(coordinator, relay, args=[mode]))
    conn = await _open_relay(relay)
    await _attach(conn)
    data, _, _ = await conn.receive()
    assert isinstance(data, Data) and data.seq == 1
    det, _, _ = await conn.receive()
    assert isinstance(det, Det) and det.index == 0
    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert done.code == 0
    code = "seq_gap" if mode == "seqgap" else "det_gap"
    assert {"refused": code} in json_lines(coordinator.output_of(7, 0))
    detach, _, _ = await conn.receive()
    assert detach == Detach(job=7, rank=0)  # the gap never reached the relay
    # The same connection serves the agent's next rank.
    coordinator.add_lease(lease_for(coordinator, relay, job=8, args=["proxy", "1"]))
    attach = await _attach(conn, job=8)
    assert attach.home
    msg, _, _ = await conn.receive()
    assert isinstance(msg, Data) and (msg.job, msg.seq) == (8, 1)


async def test_a_connection_flood_leaves_the_agent_and_its_other_ranks_be(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay
) -> None:
    """Issue 35: a rank opening tens of thousands of idle connections to the agent's socket
    ran the agent out of descriptors, and it exited. Past a few not yet greeted per sandbox
    (per process, unsandboxed) the agent closes new ones at once; a victim rank starts and
    talks meanwhile."""
    n = 900  # within the rank's own rank_open_files (1024); ranks' other processes flood too
    coordinator.add_lease(lease_for(coordinator, relay, args=["flood", str(n)]))
    conn = await _open_relay(relay)
    await _attach(conn)
    flooded = await coordinator.wait_for(
        lambda: [x for x in json_lines(coordinator.output_of(7, 0)) if "flooded" in x],
        seconds=60,
    )
    assert flooded[0]["closed"] >= n - proxy.MAX_UNGREETED_PER_PEER, flooded
    # The flood is still held open (all but a few closed by the agent): a victim runs.
    coordinator.add_lease(lease_for(coordinator, relay, job=8, args=["proxy", "1"]))
    await _attach(conn, job=8)
    msg, _, _ = await conn.receive()
    assert isinstance(msg, Data) and (msg.job, msg.seq) == (8, 1)
    coordinator.stop(7, 0, reason="enough")
    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert done.message == "stopped: enough"
    assert not agent.finished.is_set()  # the agent is up


async def test_hostile_ranks_beside_a_victim(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay
) -> None:
    """Issue 35, "ranks are untrusted at the agent": eight ranks send seeded random traffic,
    each with one hostile frame of its own kind (a message or determinant gap, a forged
    sender, another job's, a destination outside the job, garbage bytes, a checkpoint frame
    on the data connection, seq 0) at a random point, and side connections, while a victim
    rank of another job runs on the same agent and the same relay connection. The victim ends
    normally, the agent stays up, and the relay gets nothing it would refuse: in every
    channel each seq is at most one past the highest before, in every determinant log each
    index too, and nothing of another job or from another sender."""
    fuzzers = {20 + i: i for i in range(8)}
    for job, seed in fuzzers.items():
        coordinator.add_lease(
            lease_for(coordinator, relay, job=job, size=3, args=["fuzz", str(seed), "2000"])
        )
    coordinator.add_lease(lease_for(coordinator, relay, job=8, args=["proxy", "1"]))
    conn = await _open_relay(relay)
    channels: dict[tuple[int, int, int], int] = {}
    det_logs: dict[tuple[int, int], int] = {}

    async def serve_as_relay() -> None:
        while True:
            msg, _, _ = await conn.receive(seconds=120)
            if isinstance(msg, Attach):
                claims = msg.token.split("-")  # rank-token-JOB-RANK
                await conn.send(Attached(job=int(claims[2]), rank=int(claims[3]), incarnation=1))
            elif isinstance(msg, Data) and msg.job == 8:
                pushed = Data(job=8, src=1, dst=0, seq=1, ctx=0, tag=9, kind=1, parts=[3])
                await conn.send(pushed, b"abc")
                await conn.send(Ack(job=8, src=0, dst=1, seq=1))
            elif isinstance(msg, Data):
                assert msg.job in fuzzers and msg.src == 0, msg
                assert 0 <= msg.dst < 3 and msg.seq >= 1, msg
                key = (msg.job, msg.src, msg.dst)
                assert msg.seq <= channels.get(key, 0) + 1, (msg, channels.get(key))
                channels[key] = max(channels.get(key, 0), msg.seq)
            elif isinstance(msg, Det):
                assert msg.job in fuzzers and msg.rank == 0 and msg.index >= 0, msg
                key2 = (msg.job, msg.rank)
                assert msg.index <= det_logs.get(key2, 0), (msg, det_logs.get(key2))
                det_logs[key2] = max(det_logs.get(key2, 0), msg.index + 1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_as_relay)
        done = await coordinator.wait_for(lambda: coordinator.exit_of(8, 0), seconds=60)
        assert done.code == 0
        for job in fuzzers:
            await coordinator.wait_for(lambda job=job: coordinator.exit_of(job, 0), seconds=60)
        nursery.cancel_scope.cancel()
    assert {"other": "Ack", "fields": [8, 0, 1, 1]} in json_lines(coordinator.output_of(8, 0))
    reports = [
        next(x for x in json_lines(coordinator.output_of(job, 0)) if "fuzzed" in x)
        for job in fuzzers
    ]
    # Every hostile frame was sent, and its rank was cut off soon after (its writes go into
    # socket buffers until it sees the end).
    assert all(r["at"] < r["fuzzed"] < 2000 for r in reports), reports
    assert {r["hostile"] for r in reports} == {
        "seqgap",
        "detgap",
        "forged",
        "stranger",
        "baddst",
        "garbage",
        "ckpt",
        "zero",
    }
    assert channels and det_logs  # the well-formed part got through
    assert not agent.finished.is_set()
    assert not conn.closed.is_set()


async def test_a_frame_larger_than_the_ranks_memory_is_refused_at_its_prefix(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay
) -> None:
    """Issue 35: a rank held to 256 MiB sent one 700 MiB frame and its agent peaked at 3.5
    GiB. A rank cannot have a message larger than its memory limit: the agent refuses one
    announced larger before it reads any of it."""
    lease = lease_for(coordinator, relay, args=["bigframe", str(700 << 20)])
    coordinator.add_lease(msgspec.structs.replace(lease, memory=256 << 20))
    conn = await _open_relay(relay)
    await _attach(conn)
    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert done.code == 0
    assert {"refused": "frame_too_large"} in json_lines(coordinator.output_of(7, 0))
    detach, _, _ = await conn.receive()
    assert detach == Detach(job=7, rank=0)  # nothing of it reached the relay


async def test_the_agent_holds_no_more_of_a_ranks_messages_than_its_budget(
    agent: RunningAgent, coordinator: FakeCoordinator, relay: FakeRelay
) -> None:
    """Issue 35: the agent keeps a rank's messages until the relay logs them, and held as much
    as the rank sent. Now it stops reading the rank once what it holds reaches the rank's
    memory limit (64 MiB here: 15 frames of 4 MiB and their headers), and reads on as the
    relay acknowledges."""
    frame = 4 << 20
    lease = lease_for(coordinator, relay, args=["deposit", "24", str(frame)])
    coordinator.add_lease(msgspec.structs.replace(lease, memory=64 << 20))
    conn = await _open_relay(relay)
    await _attach(conn)
    sizes: list[int] = []

    async def take(count: int) -> None:
        while len(sizes) < count:
            msg, _, raw = await conn.receive()
            if isinstance(msg, Data):
                assert msg.seq == len(sizes) + 1
                sizes.append(len(raw))

    with trio.fail_after(30):
        await take(15)
    assert sum(sizes) <= 64 << 20 < sum(sizes) + sizes[-1]
    # Nothing more comes while the relay acknowledges nothing (before the fix, all 24 did).
    with trio.move_on_after(1):
        await take(16)
    assert len(sizes) == 15
    await conn.send(Ack(job=7, src=0, dst=1, seq=5))  # 5 logged: room for 5 more
    with trio.fail_after(30):
        await take(20)
    await conn.send(Ack(job=7, src=0, dst=1, seq=20))
    with trio.fail_after(30):
        await take(24)
    await conn.send(Ack(job=7, src=0, dst=1, seq=24))
    done = await coordinator.wait_for(lambda: coordinator.exit_of(7, 0))
    assert done.code == 0
    assert {"acked": 24} in json_lines(coordinator.output_of(7, 0))
    assert coordinator.problems == []
