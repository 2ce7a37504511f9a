"""Links that notice: the agent's relay links (``RelayLinks``, real TLS) against a real relay
through a TCP relay-through that can turn into a black hole, as a middlebox that forgot a
connection does (both TCP connections stay open, every byte is lost both ways). The agent
declares such a connection dead within ``relay_dead_after``, reconnects once the way is open
again and delivers every message exactly once; the relay closes its half after
``agent_idle_timeout``; an idle connection that is alive is never closed. The agent's HTTP
client gives up a black-holed coordinator request and retries it on a new connection."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from vpool.protocol import api, tokens
from vpool.protocol.framing import FrameDecoder, encode_frame
from vpool.protocol.messages import (
    PROTOCOL_VERSION,
    Ack,
    Data,
    Hello,
    Message,
    Ping,
    Pong,
    Welcome,
)
from vpool.relay.hub import Hub
from vpool.relay.server import serve_relay
from vpool.relay.settings import RelaySettings
from vpool.tls import client_context
from vpool.worker_agent import coordinator as coordinator_client
from vpool.worker_agent.local_ranks import LocalRank
from vpool.worker_agent.relay_link import RelayLink
from vpool.worker_agent.relay_links import RelayLinks

from .conftest import FakeCoordinator, FakeRelay, Pki

DEADLINE = 20.0
# The machine to itself: these tests measure pings and silences against the wall clock (beside
# another pytest worker one saw a ping come 8 ms after the silence began, not 150).
pytestmark = pytest.mark.exclusive
AGENT = "agent-1"


# -- a relay-through that can become a black hole -------------------------------------------


@dataclass
class Pipe:
    """One connection through the relay-through: bytes forwarded each way, and when each side
    ended ("up": the agent's, "down": the relay's)."""

    holed: bool = False
    forwarded: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0})
    ended: dict[str, float] = field(default_factory=dict)


class BlackHole:
    """Forwards TCP connections from 127.0.0.1:``port`` to ``target``. ``cut()``: every
    connection it carries becomes a black hole (stays open, loses every byte both ways, passes
    no end of stream on) and new ones are refused (closed at once), until ``mend()``; holed
    connections stay holed (their streams lost bytes: they are dead for good)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = 0
        self.is_cut = False
        self.pipes: list[Pipe] = []
        self.refused = 0
        self._changed = trio.Event()

    def _touch(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_for(self, check: Callable[[], Any], seconds: float = DEADLINE) -> None:
        with trio.fail_after(seconds):
            while not check():
                await self._changed.wait()

    def cut(self) -> None:
        self.is_cut = True
        for pipe in self.pipes:
            pipe.holed = True

    def mend(self) -> None:
        self.is_cut = False

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._handle, listeners)
            task_status.started(self.port)

    async def _handle(self, agent: trio.SocketStream) -> None:
        if self.is_cut:
            self.refused += 1
            self._touch()
            await trio.aclose_forcefully(agent)
            return
        relay = await trio.open_tcp_stream(*self.target)
        pipe = Pipe()
        self.pipes.append(pipe)
        self._touch()
        async with relay, trio.open_nursery() as nursery:
            nursery.start_soon(self._pump, agent, relay, pipe, "up")
            nursery.start_soon(self._pump, relay, agent, pipe, "down")

    async def _pump(
        self, src: trio.SocketStream, dst: trio.SocketStream, pipe: Pipe, way: str
    ) -> None:
        try:
            while data := await src.receive_some(65536):
                if not pipe.holed:
                    pipe.forwarded[way] += len(data)
                    await dst.send_all(data)
                    self._touch()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        pipe.ended[way] = trio.current_time()
        self._touch()
        if not pipe.holed:
            await trio.aclose_forcefully(dst)


# -- a real relay, an agent's links, two ranks ---------------------------------------------


@dataclass
class Side:
    """What one rank's outbox got from the relay, decoded."""

    frames: list[tuple[Message, bytes]] = field(default_factory=list)
    changed: trio.Event = field(default_factory=trio.Event)

    def data(self) -> list[tuple[int, int, bytes]]:
        return [(m.src, m.seq, p) for m, p in self.frames if isinstance(m, Data)]

    def acked(self, dst: int) -> int:
        acks = [m.seq for m, _ in self.frames if isinstance(m, Ack) and m.dst == dst]
        return max(acks, default=0)

    async def wait_for(self, check: Callable[[], Any], seconds: float = DEADLINE) -> None:
        with trio.fail_after(seconds):
            while not check():
                await self.changed.wait()


async def _drain(rank: LocalRank, side: Side) -> None:
    """What the rank's socket writer would do (credits are left out: few small frames)."""
    decoder = FrameDecoder()
    while True:
        batch, _ = await rank.outbox.take()
        rank.outbox.busy = False
        for parts in batch:
            for part in parts:
                decoder.receive_data(part)
        while (frame := decoder.next_frame()) is not None:
            side.frames.append((frame.message, frame.payload))
        side.changed.set()
        side.changed = trio.Event()


@dataclass
class Setup:
    links: RelayLinks
    info: api.RelayInfo
    hub: Hub
    key: Ed25519PrivateKey
    problems: list[tuple[LocalRank, str, str]]

    def rank(self, rank: int) -> LocalRank:
        claims = tokens.RankClaims(
            job=7, rank=rank, incarnation=1, size=2, agent=AGENT, expires=time.time() + 3600
        )
        lease = api.Lease(
            job=7,
            rank=rank,
            incarnation=1,
            size=2,
            token=tokens.sign_token(claims, self.key),
            bundle="",
            entry="app.py",
            args=[],
            stdin=None,
            relays=[self.info],
            homes=[0, 0],
        )
        return LocalRank(lease)


async def _setup(
    nursery: trio.Nursery,
    pki: Pki,
    tmp_path: Path,
    *,
    idle_timeout: float,
    ping_interval: float | None,
    dead_after: float | None,
    through: BlackHole | None = None,
) -> Setup:
    key = Ed25519PrivateKey.generate()
    settings = RelaySettings(
        name="relay-a",
        host="127.0.0.1",
        port=0,
        data_dir=str(tmp_path / "relay"),
        tls_cert=str(pki.cert),
        tls_key=str(pki.key),
        agent_idle_timeout=idle_timeout,
        lost_grace=30.0,
    )
    hubs_in, hubs_out = trio.open_memory_channel[Hub](1)
    host, port = await nursery.start(
        functools.partial(serve_relay, settings, signing_key=key.public_key(), hub_ready=hubs_in)
    )
    hub = await hubs_out.receive()
    if through is not None:
        through.target = (host, port)
        port = await nursery.start(through.serve)
    problems: list[tuple[LocalRank, str, str]] = []
    agent_token = tokens.sign_token(
        tokens.AgentClaims(agent=AGENT, expires=time.time() + 3600), key
    )
    timing = {}
    if ping_interval is not None and dead_after is not None:
        timing = {"ping_interval": ping_interval, "dead_after": dead_after}
    links = RelayLinks(
        nursery,
        ssl_context=client_context(pki.ca),
        token=lambda: agent_token,
        on_problem=lambda rank, msg, relay: problems.append((rank, msg, relay)),
        max_payload=1 << 20,
        reconnect=60.0,
        **timing,
    )
    info = api.RelayInfo(name="relay-a", host="127.0.0.1", port=port)
    return Setup(links, info, hub, key, problems)


async def _deposit(link: RelayLink, seq: int) -> None:
    msg = Data(job=7, src=0, dst=1, seq=seq, ctx=0, tag=0)
    await link.send_data(msg, [encode_frame(msg, b"message %d" % seq)])


@pytest.mark.parametrize(
    "ping_interval,dead_after",
    [
        pytest.param(0.25, 1.0, id="short"),
        # The defaults (5 s, 12 s): the bound is 15 s, measured on the wall clock.
        pytest.param(None, None, id="defaults", marks=[pytest.mark.slow, pytest.mark.exclusive]),
    ],
)
@pytest.mark.medium
async def test_a_black_holed_connection_is_declared_dead_and_resumed(
    nursery: trio.Nursery,
    pool_pki: Pki,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    ping_interval: float | None,
    dead_after: float | None,
) -> None:
    caplog.set_level(logging.INFO, logger="vpool.agent")
    hole = BlackHole(("", 0))
    idle_timeout = 2.0 if dead_after is not None else 15.0
    setup = await _setup(
        nursery,
        pool_pki,
        tmp_path,
        idle_timeout=idle_timeout,
        ping_interval=ping_interval,
        dead_after=dead_after,
        through=hole,
    )
    link = await setup.links.get(setup.info)
    dead_after = setup.links.dead_after
    sender, receiver = setup.rank(0), setup.rank(1)
    got_sender, got_receiver = Side(), Side()
    nursery.start_soon(_drain, sender, got_sender)
    nursery.start_soon(_drain, receiver, got_receiver)
    await link.attach(sender, home=True)
    await link.attach(receiver, home=True)

    await _deposit(link, 1)
    await got_sender.wait_for(lambda: got_sender.acked(1) == 1)
    first = link.current
    assert first is not None and len(hole.pipes) == 1

    # The middlebox forgets the connection: the next message and the pings vanish.
    hole.cut()
    cut_at = trio.current_time()
    await _deposit(link, 2)
    [pipe] = hole.pipes
    await hole.wait_for(lambda: "up" in pipe.ended, seconds=dead_after + 5)
    detected = pipe.ended["up"] - cut_at
    print(f"agent declared the black-holed connection dead after {detected:.2f} s")
    assert dead_after - 0.1 <= detected <= dead_after + 1.0

    # Unreachable meanwhile: the link keeps trying, the ranks stay attached, and a message
    # sent now waits for the connection.
    await hole.wait_for(lambda: hole.refused >= 2)
    assert link.current is None and link.broken is None
    assert any("s: dead); reconnecting" in r.getMessage() for r in caplog.records), caplog.text
    nursery.start_soon(_deposit, link, 3)
    hole.mend()
    await got_receiver.wait_for(lambda: len(got_receiver.data()) >= 3)
    await _deposit(link, 4)
    await got_sender.wait_for(lambda: got_sender.acked(1) == 4)
    await got_receiver.wait_for(lambda: len(got_receiver.data()) >= 4)
    assert got_receiver.data() == [(0, s, b"message %d" % s) for s in (1, 2, 3, 4)]
    assert link.current is not None and link.current is not first
    assert setup.problems == []
    assert setup.hub.core.boxes[(7, 1)].mailbox.acked(0) == 4

    # The relay's half of the dead connection is closed once it brought nothing for its
    # agent_idle_timeout (the new connection's pings do not count for it).
    await hole.wait_for(lambda: "down" in pipe.ended, seconds=idle_timeout + 5)
    assert pipe.ended["down"] - cut_at >= idle_timeout - 0.5
    assert got_receiver.data() == [(0, s, b"message %d" % s) for s in (1, 2, 3, 4)]


@pytest.mark.medium
async def test_an_idle_connection_that_is_alive_stays(
    nursery: trio.Nursery, pool_pki: Pki, tmp_path: Path
) -> None:
    # Pings every 0.2 s, given up after 1.5 s, and a relay that closes a connection silent for
    # 1 s: nothing but the pings and their pongs keeps it up.
    hole = BlackHole(("", 0))
    setup = await _setup(
        nursery,
        pool_pki,
        tmp_path,
        idle_timeout=1.0,
        ping_interval=0.2,
        dead_after=1.5,
        through=hole,
    )
    link = await setup.links.get(setup.info)
    sender, receiver = setup.rank(0), setup.rank(1)
    got = Side()
    nursery.start_soon(_drain, receiver, got)
    nursery.start_soon(_drain, sender, Side())
    await link.attach(sender, home=True)
    await link.attach(receiver, home=True)
    first = link.current
    [pipe] = hole.pipes
    before = dict(pipe.forwarded)
    # A span of 15 ping intervals (3 of the relay's idle timeouts) with nothing to send.
    await trio.sleep(3.0)
    assert link.current is first and pipe.ended == {} and len(hole.pipes) == 1
    assert len(setup.hub.connections) == 1
    # About one Ping and one Pong each 0.2 s went through (encrypted, some 40 bytes each).
    assert pipe.forwarded["up"] - before["up"] >= 5 * 30
    assert pipe.forwarded["down"] - before["down"] >= 5 * 30
    await _deposit(link, 1)
    await got.wait_for(lambda: len(got.data()) == 1)
    assert setup.problems == []


async def test_the_agent_answers_pings_and_pings_only_a_relay_that_answers(
    nursery: trio.Nursery, relay: FakeRelay, pool_pki: Pki
) -> None:
    def links() -> RelayLinks:
        return RelayLinks(
            nursery,
            ssl_context=client_context(pool_pki.ca),
            token=lambda: "agent-token",
            on_problem=lambda rank, msg, name: None,
            max_payload=1 << 20,
            ping_interval=0.2,
            dead_after=0.5,
        )

    # A relay of before pings (no Welcome.pings) is never pinged, and never given up.
    nursery.start_soon(links().get, relay.info)
    conn = await relay.accept()
    hello, _, _ = await conn.receive()
    assert isinstance(hello, Hello) and hello.pings
    await conn.send(Welcome(version=PROTOCOL_VERSION, relay="relay-0"))
    with trio.move_on_after(1.0):
        msg, _, _ = await conn.receive()
        raise AssertionError(f"the agent sent {msg!r} to a relay that does not ping")
    assert not conn.closed.is_set()
    await conn.close()

    # One that does: a Ping of its own is answered, a quiet one is pinged, and one that
    # answers nothing is given up (the connection closed) after dead_after.
    nursery.start_soon(links().get, relay.info)
    conn = await relay.accept()
    hello, _, _ = await conn.receive()
    await conn.send(Welcome(version=PROTOCOL_VERSION, relay="relay-0", pings=True))
    await conn.send(Ping(nonce=42))
    assert (await conn.receive())[0] == Pong(nonce=42)
    start = trio.current_time()
    assert (await conn.receive())[0] == Ping(nonce=1)
    assert 0.15 <= trio.current_time() - start <= 1.0
    await conn.send(Pong(nonce=1))
    answered = trio.current_time()
    assert (await conn.receive())[0] == Ping(nonce=2)
    with trio.fail_after(5):
        while True:
            try:
                data = await conn.stream.receive_some(65536)
            except trio.BrokenResourceError:
                break
            if not data:
                break
    # Given up dead_after after the Pong, the last thing it heard (pinged again meanwhile).
    assert 0.4 <= trio.current_time() - answered <= 1.5


# -- the coordinator -------------------------------------------------------------------------


async def test_a_black_holed_coordinator_request_is_retried_on_a_new_connection(
    nursery: trio.Nursery,
    https_coordinator: str,
    coordinator: FakeCoordinator,
    pool_pki: Pki,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(coordinator_client, "HOLD_MARGIN", 0.5)
    url = httpx.URL(https_coordinator)
    hole = BlackHole((url.host, url.port or 443))
    port = await nursery.start(hole.serve)
    client = coordinator_client.CoordinatorClient(
        f"https://127.0.0.1:{port}", ca=pool_pki.ca, retry_max_delay=0.2
    )
    client.token = "agent-token"
    async with client:
        await client.heartbeat(api.AgentHeartbeat(ranks=[], free_slots=1))
        assert len(hole.pipes) == 1
        hole.cut()
        start = trio.current_time()
        with pytest.raises(coordinator_client.CoordinatorUnreachable, match="ReadTimeout"):
            await client.heartbeat(api.AgentHeartbeat(ranks=[], free_slots=1, wait=0.2))
        # Given up a hold plus HOLD_MARGIN after it was sent, not 30 s later.
        assert trio.current_time() - start <= 0.2 + 0.5 + 1.0
        hole.mend()
        await client.post_output(api.OutputBatch(chunks=[]))
        # The failed request's connection was not used again.
        assert len(hole.pipes) == 2 and hole.pipes[1].forwarded["down"] > 0
