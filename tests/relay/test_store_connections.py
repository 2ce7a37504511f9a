"""Store connections beside agent connections on one port: sorted by their preamble, served by
bounded worker threads, unblocked when the relay stops, closed when idle; plain TCP too."""

from __future__ import annotations

import os
import ssl
import threading
from pathlib import Path
from typing import Any

import pytest
import trio
from relay_fakes import DEADLINE, FakeAgent, Pool, start_relay
from store_fakes import MiB, get, image, open_store, put, store_conn, until

from vpool.protocol.framing import PREFIX
from vpool.protocol.messages import (
    PROTOCOL_VERSION,
    CkptChunk,
    CkptPut,
    CkptStored,
    Error,
    Hello,
    Welcome,
)


async def test_preamble_sorts_connections_on_one_port(
    pool: Pool, relay: Any, agents: list[Any]
) -> None:
    healthy = await FakeAgent.connect(pool, relay.addr, "agent-h")
    receiver = await FakeAgent.connect(pool, relay.addr, "agent-r")
    await healthy.attach(pool, 7, 0, size=2)
    await receiver.attach(pool, 7, 1, size=2, home=True)
    await healthy.deposit(7, 0, 1, 1, b"before")

    # A wrong preamble: that connection is closed before TLS, nothing else happens.
    with pytest.raises((ssl.SSLError, OSError)):
        await open_store(relay.addr, pool.client_ssl, preamble=b"VPSTORE\x02")
    raw = await trio.open_tcp_stream(*relay.addr)
    await raw.send_all(b"Vx")  # a short preamble
    await raw.send_eof()
    with trio.fail_after(DEADLINE):
        assert await raw.receive_some(10) == b""
    await raw.aclose()
    # A store Hello on an agent connection (no preamble) is refused.
    bad = await FakeAgent.connect(pool, relay.addr, "agent-1", hello=False)
    await bad.send(Hello(version=PROTOCOL_VERSION, role="store", token=pool.agent_token("agent-1")))
    err = await bad.expect_error("protocol_error")
    assert "preamble" in err.message

    # Garbage on a store connection closes that one.
    garbage = await store_conn(pool, relay.addr, "agent-r")
    await trio.to_thread.run_sync(garbage.client.sock.sendall, PREFIX.pack(6, 0) + b"\xc1" * 6)
    err = await garbage.expect_error("bad_frame")
    assert err.rank == -1

    # Store and agent connections side by side.
    store = await store_conn(pool, relay.addr, "agent-r")
    assert await put(store, pool, 7, 1, 1, image(1, MiB + 5)) == CkptStored(ckpt=1, retained=[1])
    await healthy.deposit(7, 0, 1, 2, b"after")
    await healthy.acks_until(7, 0, 1, 2)
    got = [await receiver.next_data() for _ in range(2)]
    assert [p for _, p in got] == [b"before", b"after"]


async def test_plain_tcp_relay(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: list[Any]
) -> None:
    settings = pool.settings(tmp_path / "relay", tls_cert="", tls_key="", insecure_tcp=True)
    relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    stream = await trio.open_tcp_stream(*relay.addr)
    agent = FakeAgent(stream, "agent-1")
    agents.append(agent)
    await agent.send(
        Hello(version=PROTOCOL_VERSION, role="agent", token=pool.agent_token("agent-1"))
    )
    await agent.expect(Welcome)
    await agent.attach(pool, 2, 0, size=1)
    store = await store_conn(pool, relay.addr, tls=False)
    data = image(3, 3 * MiB + 17)
    assert await put(store, pool, 2, 0, 3, data) == CkptStored(ckpt=3, retained=[3])
    got = await get(store, pool, 2, 0, 3)
    assert not isinstance(got, Error) and got[1] == data


async def test_stopping_relay_ends_store_threads(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: list[Any]
) -> None:
    relay = await start_relay(
        nursery, pool.settings(tmp_path / "relay"), signing_key=pool.key.public_key()
    )
    idle = await store_conn(pool, relay.addr, "agent-1")  # blocked reading its next frame
    store = await store_conn(pool, relay.addr, "agent-2")
    token = pool.rank_token(1, 0, agent="agent-2", size=1)
    await store.send(CkptPut(token=token, ckpt=1, received={}, dets=0, fingerprint="fp"))
    await store.send(CkptChunk(ckpt=1), b"p" * MiB)
    ckpt = tmp_path / "relay" / "jobs" / "1" / "0" / "ckpt"
    await until(lambda: ckpt.is_dir() and any(p.suffix == ".part" for p in ckpt.iterdir()))
    assert relay.hub.store.limiter.borrowed_tokens == 2
    await relay.stop()  # within DEADLINE: both threads were unblocked and joined
    assert relay.hub.store.limiter.borrowed_tokens == 0
    assert list(ckpt.iterdir()) == []
    assert not relay.hub.store.uploading
    for conn in (idle, store):
        with pytest.raises(EOFError):
            await conn.recv()


async def test_thread_bound_and_idle_timeout(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: list[Any]
) -> None:
    settings = pool.settings(tmp_path / "relay", store_threads=1, store_idle_timeout=0.5)
    relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    limiter = relay.hub.store.limiter
    first = await store_conn(pool, relay.addr, "agent-1")
    second: list[Any] = []

    async def connect_second() -> None:
        second.append(await store_conn(pool, relay.addr, "agent-2"))

    async with trio.open_nursery() as inner:
        inner.start_soon(connect_second)
        # The second connection waits for the only thread, busy with the first.
        await until(lambda: limiter.statistics().tasks_waiting == 1)
        assert not second
        # The first says nothing: closed after store_idle_timeout, with an Error.
        err = await first.expect_error("timeout")
        assert err.rank == -1
        await first.aclose()
    assert second[0].welcome is not None
    assert await put(second[0], pool, 1, 0, 1, b"img") == CkptStored(ckpt=1, retained=[1])


async def test_store_sessions_run_nicer_than_the_relay(
    pool: Pool, relay: Any, agents: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``store_nice`` (default 19): each store connection is served by a thread of its own at
    that niceness, and the relay's loop and pooled threads keep theirs; puts and gets still
    reach the loop from there (``StoreThread.token``)."""
    from vpool.relay import storethread

    seen: list[tuple[int, int]] = []
    real_run = storethread.StoreThread.run

    def run(self: storethread.StoreThread) -> None:
        tid = threading.get_native_id()
        seen.append((tid, os.getpriority(os.PRIO_PROCESS, tid)))
        real_run(self)

    monkeypatch.setattr(storethread.StoreThread, "run", run)
    conn = await store_conn(pool, relay.addr)
    data = image(1, MiB + 5)
    assert await put(conn, pool, 6, 0, 1, data) == CkptStored(ckpt=1, retained=[1])
    got = await get(conn, pool, 6, 0, 1)
    assert not isinstance(got, Error) and got[1] == data
    loop = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen == [(seen[0][0], min(loop + 19, 19))]
    pooled = await trio.to_thread.run_sync(
        lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    )
    assert pooled == loop
