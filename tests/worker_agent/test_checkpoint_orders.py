"""``vsdk checkpoint`` orders reach the agent at least once: the agent's real heartbeat loop
against the real coordinator (in process, through httpx), with a wire in between that loses
what the test says. An answer that never reached the agent is handed out again; an order that
arrives twice is acted on once and acknowledged until the coordinator has deleted it."""

from __future__ import annotations

import contextlib
import importlib.util
import sqlite3
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import trio

from vpool.coordinator.app import create_app
from vpool.protocol import api
from vpool.worker_agent.agent import Agent, CheckpointOrderIds, enroll
from vpool.worker_agent.coordinator import CoordinatorClient
from vpool.worker_agent.identity import load_or_create_key
from vpool.worker_agent.local_ranks import LocalRank
from vpool.worker_agent.settings import AgentSettings


def _coord_helpers() -> Any:
    """``tests/coordinator/coord_helpers.py`` (registered by path, as its conftest does)."""
    if "coord_helpers" not in sys.modules:
        path = Path(__file__).parents[1] / "coordinator" / "coord_helpers.py"
        spec = importlib.util.spec_from_file_location("coord_helpers", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["coord_helpers"] = module
        spec.loader.exec_module(module)
    return sys.modules["coord_helpers"]


helpers = _coord_helpers()
HEARTBEAT = "/api/v1/agents/heartbeat"


@dataclass
class Beat:
    sent: api.AgentHeartbeat  # as the agent sent it
    answer: api.AgentHeartbeatResponse | None = None  # as the agent got it (None: lost)


@dataclass
class Wire(httpx.AsyncBaseTransport):
    """Between the agent and the coordinator: records heartbeats, and loses the answer of the
    first ``drop_answers`` heartbeats answered with checkpoint orders (after the coordinator
    handled them) and the acknowledgements of the first ``drop_acks`` that carry some."""

    inner: httpx.AsyncBaseTransport
    drop_answers: int = 0
    drop_acks: int = 0
    beats: list[Beat] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.changed = trio.Event()

    async def wait_for(self, predicate: Callable[[], Any], seconds: float = 20.0) -> Any:
        with trio.fail_after(seconds):
            while not (result := predicate()):
                await self.changed.wait()
        return result

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != HEARTBEAT:
            return await self.inner.handle_async_request(request)
        try:
            return await self._heartbeat(request)
        finally:
            self.changed.set()
            self.changed = trio.Event()

    async def _heartbeat(self, request: httpx.Request) -> httpx.Response:
        hb = msgspec.json.decode(await request.aread(), type=api.AgentHeartbeat)
        beat = Beat(hb)
        self.beats.append(beat)
        if hb.checkpoint_acks and self.drop_acks:
            self.drop_acks -= 1
            headers = {k: v for k, v in request.headers.items() if k != "content-length"}
            content = msgspec.json.encode(msgspec.structs.replace(hb, checkpoint_acks=[]))
            request = httpx.Request(request.method, request.url, headers=headers, content=content)
        response = await self.inner.handle_async_request(request)
        body = await response.aread()
        answer = msgspec.json.decode(body, type=api.AgentHeartbeatResponse)
        if answer.checkpoint and self.drop_answers:
            self.drop_answers -= 1
            raise httpx.ReadError("the connection broke", request=request)
        beat.answer = answer
        return httpx.Response(response.status_code, headers=response.headers, content=body)


@dataclass
class Setup:
    pool: Any  # coord_helpers.Pool: the user's and relay's side
    wire: Wire
    agent: Agent
    rank: LocalRank


@pytest.fixture
async def setup(
    tmp_path: Path, settings: AgentSettings, nursery: trio.Nursery
) -> AsyncIterator[Setup]:
    core = helpers.new_core(tmp_path / "coord", helpers.FakeClock(), heartbeat_interval=0.2)
    app = create_app(core.settings, coordinator=core)
    wire = Wire(httpx.ASGITransport(app=app))
    try:
        async with (
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://coordinator"
            ) as user_client,
            CoordinatorClient("http://coordinator", transport=wire) as client,
        ):
            pool = helpers.Pool(user_client, core, core.clock)
            await pool.register_relay("relay-0")
            bundle = await pool.upload(helpers.make_zip({"app.py": helpers.HELLO}))
            sub = api.JobSubmit(ranks=1, bundle=bundle, entry="app.py", fault_tolerance=True)
            assert (await pool.post("/api/v1/jobs", sub, pool.user())).status_code == 201
            enrolled = await enroll(settings, client, load_or_create_key(settings.identity_path))
            agent = Agent(settings, client, enrolled, nursery)
            agent.capability.criu = "4.1.1"
            agent.capability.fingerprint = "f" * 64
            agent.capability.ready.set()
            # An agent gets ranks once it said how it isolates them.
            agent.isolation = helpers.SANDBOX
            agent.isolation_known.set()
            await client.heartbeat(
                api.AgentHeartbeat(ranks=[], free_slots=1, isolation=helpers.SANDBOX)
            )
            [lease] = await client.lease(free_slots=1, wait=0.0)
            rank = LocalRank(lease)
            rank.state = "running"  # no process: the test plays the rank's checkpointer
            agent.ranks.add(rank)
            async with trio.open_nursery() as inner:
                inner.start_soon(agent.heartbeat_loop)
                yield Setup(pool, wire, agent, rank)
                inner.cancel_scope.cancel()
    finally:
        core.close()


def _queued(pool: Any) -> list[int]:
    """The orders queued now, read on a connection of the test's own: the store's connection
    belongs to the worker thread of its limiter (``Coordinator.db``), and the agent's
    heartbeats run transactions on it meanwhile (sqlite-utils 4 reads in a savepoint, whose
    release here would end such a transaction under its feet)."""
    path = pool.core.settings.state_path() / "vpool.db"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return [row[0] for row in conn.execute("SELECT id FROM checkpoint_orders")]


async def _ask(s: Setup) -> int:
    job = s.rank.lease.job
    # The first heartbeat makes the rank "running" on the coordinator's side.
    await s.wire.wait_for(lambda: any(b.answer for b in s.wire.beats))
    r = await s.pool.post(f"/api/v1/jobs/{job}/checkpoint", api.CheckpointAsk(), s.pool.user())
    assert r.status_code == 202, r.text
    [order_id] = _queued(s.pool)
    return int(order_id)


def _delivered(s: Setup, order_id: int) -> list[int]:
    """Indices of the beats whose answer brought the order to the agent."""
    return [
        i
        for i, b in enumerate(s.wire.beats)
        if b.answer and any(o.id == order_id for o in b.answer.checkpoint)
    ]


async def test_an_order_whose_answer_was_lost_comes_again(setup: Setup) -> None:
    s = setup
    s.wire.drop_answers = 1
    order_id = await _ask(s)
    with trio.fail_after(20):
        await s.rank.checkpoint_wanted.wait()
    assert s.wire.drop_answers == 0  # the first answer with the order was lost
    assert len(_delivered(s, order_id)) == 1
    # Acknowledged in the next heartbeat, then deleted: it is not handed out again.
    await s.wire.wait_for(lambda: not _queued(s.pool))
    acked = next(i for i, b in enumerate(s.wire.beats) if order_id in b.sent.checkpoint_acks)
    assert acked > _delivered(s, order_id)[0]
    await s.wire.wait_for(lambda: len(s.wire.beats) > acked + 2)
    assert len(_delivered(s, order_id)) == 1


async def test_a_redelivered_order_is_acted_on_once_and_acknowledged(setup: Setup) -> None:
    s = setup
    s.wire.drop_acks = 1  # the first acknowledgement is lost: the order comes again
    order_id = await _ask(s)
    with trio.fail_after(20):
        await s.rank.checkpoint_wanted.wait()
    s.rank.checkpoint_wanted = trio.Event()  # taken, as the rank's checkpointer does
    await s.wire.wait_for(lambda: len(_delivered(s, order_id)) >= 2)
    first, second = _delivered(s, order_id)[:2]
    # It keeps being acknowledged until a heartbeat carrying the ack was answered (the
    # coordinator then deleted it); heartbeats after that carry no ack.
    beats = s.wire.beats

    def answered_ack() -> int | None:
        later = range(second + 1, len(beats))
        return next((i for i in later if beats[i].answer and beats[i].sent.checkpoint_acks), None)

    answered = await s.wire.wait_for(answered_ack)
    await s.wire.wait_for(lambda: len(beats) > answered + 1)
    assert all(beats[i].sent.checkpoint_acks == [order_id] for i in range(first + 1, answered + 1))
    assert beats[answered + 1].sent.checkpoint_acks == []
    assert _queued(s.pool) == []
    assert not s.rank.checkpoint_wanted.is_set()  # not a second checkpoint
    assert _delivered(s, order_id) == [first, second]


def test_order_ids_are_bounded_and_id_0_is_never_acknowledged() -> None:
    ids = CheckpointOrderIds(limit=3)
    assert ids.received(0) and ids.received(0)  # from a coordinator that numbers none
    assert ids.acks() == []
    assert [ids.received(i) for i in (1, 2, 1)] == [True, True, False]
    assert ids.acks() == [1, 2]
    ids.answered([1])
    assert ids.acks() == [2]
    for i in (3, 4, 5):
        assert ids.received(i)
    assert ids.acks() == [3, 4, 5]  # the oldest forgotten first
    assert ids.received(1)  # forgotten: a very old order would be acted on again
