"""Store connections beside agent connections on one port: sorted by their preamble, served by
bounded worker threads, unblocked when the relay stops, closed when idle; plain TCP too."""

from __future__ import annotations

import logging
import os
import ssl
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import trio
from relay_fakes import DEADLINE, FakeAgent, Pool, start_relay
from store_fakes import MAC_KEY, MiB, ckpt_files, get, image, open_store, put, store_conn, until

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
from vpool.relay.storelink import NoAnswer, Reply

pytestmark = pytest.mark.large


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
    err = await bad.expect_error("unexpected_message")
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
    await store.send(
        CkptPut(token=token, ckpt=1, received={}, dets=0, fingerprint="fp", mac_key=MAC_KEY)
    )
    await store.send(CkptChunk(ckpt=1), b"p" * MiB)
    ckpt = tmp_path / "relay" / "jobs" / "1" / "0" / "ckpt"
    await until(lambda: ckpt.is_dir() and any(p.suffix == ".part" for p in ckpt.iterdir()))
    supervisor = relay.hub.store.supervisor
    assert supervisor.limiter.borrowed_tokens == 2
    process = supervisor.current.proc
    await relay.stop()  # within DEADLINE: both threads were unblocked and joined
    assert supervisor.limiter.borrowed_tokens == 0
    assert list(ckpt.iterdir()) == []  # the thread deleted its part file
    assert not relay.hub.store.uploading
    for conn in (idle, store):
        with pytest.raises(EOFError):
            await conn.recv()
    # The store process saw the link end, ended its sessions and exited by itself.
    assert process.returncode == 0


async def test_store_process_death_ends_its_sessions_only(
    pool: Pool, relay: Any, tmp_path: Path, agents: list[Any]
) -> None:
    """A store process that dies (killed here) ends its sessions: their uploads are released
    and their part files deleted by the relay. Agent connections go on, and the next store
    connection gets a new store process."""
    agent = await FakeAgent.connect(pool, relay.addr, "agent-a")
    await agent.attach(pool, 1, 1, size=2, home=True)
    store = await store_conn(pool, relay.addr, "agent-2")
    token = pool.rank_token(1, 0, agent="agent-2", size=2)
    await store.send(
        CkptPut(token=token, ckpt=1, received={}, dets=0, fingerprint="fp", mac_key=MAC_KEY)
    )
    await store.send(CkptChunk(ckpt=1), b"p" * MiB)
    ckpt = tmp_path / "relay" / "jobs" / "1" / "0" / "ckpt"
    await until(lambda: ckpt.is_dir() and any(p.suffix == ".part" for p in ckpt.iterdir()))
    supervisor = relay.hub.store.supervisor
    first = supervisor.current.proc
    assert (1, 0) in relay.hub.store.uploading
    first.kill()
    with pytest.raises(EOFError):
        await store.recv()
    await until(lambda: not relay.hub.store.uploading and supervisor.limiter.borrowed_tokens == 0)
    await until(lambda: not any(p.suffix == ".part" for p in ckpt.iterdir()))
    assert first.returncode == -9
    # The relay's loop is untouched: a message still goes through.
    sender = await FakeAgent.connect(pool, relay.addr, "agent-b")
    await sender.attach(pool, 1, 0, size=2)
    await sender.deposit(1, 0, 1, 1, b"still here")
    assert (await agent.next_data())[1] == b"still here"
    # A new process serves the next store connection, and the rank may upload again.
    again = await store_conn(pool, relay.addr, "agent-2")
    data = image(1, MiB + 3)
    assert await put(again, pool, 1, 0, 1, data) == CkptStored(ckpt=1, retained=[1])
    assert supervisor.pid not in (None, first.pid)


async def test_thread_bound_and_idle_timeout(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path, agents: list[Any]
) -> None:
    settings = pool.settings(tmp_path / "relay", store_threads=1, store_idle_timeout=0.5)
    relay = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    limiter = relay.hub.store.supervisor.limiter
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


def _thread_niceness(pid: int) -> dict[int, int]:
    """The niceness of each thread of process ``pid``."""
    return {
        int(tid): os.getpriority(os.PRIO_PROCESS, int(tid))
        for tid in os.listdir(f"/proc/{pid}/task")
    }


async def test_store_sessions_run_in_a_nicer_process(
    pool: Pool, relay: Any, agents: list[Any]
) -> None:
    """``store_nice`` (default 19): store connections are served by the relay's store
    process, started at the first of them, whose threads all run at that niceness, while the
    relay's loop and pooled threads keep theirs; puts and gets still reach the relay's state
    through the link."""
    supervisor = relay.hub.store.supervisor
    assert supervisor.pid is None
    conn = await store_conn(pool, relay.addr)
    data = image(1, MiB + 5)
    assert await put(conn, pool, 6, 0, 1, data) == CkptStored(ckpt=1, retained=[1])
    got = await get(conn, pool, 6, 0, 1)
    assert not isinstance(got, Error) and got[1] == data
    pid = supervisor.pid
    assert pid is not None and pid != os.getpid()
    loop = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    nice = _thread_niceness(pid)
    assert len(nice) >= 2  # the link's reader and the connection's thread
    assert set(nice.values()) == {min(loop + 19, 19)}
    pooled = await trio.to_thread.run_sync(
        lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    )
    assert pooled == loop
    # Same process group and session as the relay (one scheduler autogroup with the ranks).
    assert (os.getpgid(pid), os.getsid(pid)) == (os.getpgid(0), os.getsid(0))


# A store process that answers a store connection with a call the relay cannot answer, notes
# the relay's reply, then calls with a request of a type the link does not know.
BAD_STORE_PROCESS = """
import os, socket, sys
import msgspec
from vpool.relay.storelink import MAX_PACKET, Call, Commit, encode, received_fds, to_worker
link = socket.socket(fileno=int(sys.argv[2]))
to_worker.decode(link.recv(MAX_PACKET))  # Init
data, ancdata, _, _ = link.recvmsg(MAX_PACKET, socket.CMSG_SPACE(16))
conn, fds = to_worker.decode(data), received_fds(ancdata)
bad = Commit(manifest=b"not a manifest", directory="/", wait=1.0)
link.send(encode(Call(rid=1, cid=conn.cid, request=bad)))
reply = to_worker.decode(link.recv(MAX_PACKET))
with open(os.environ["BAD_STORE_OUT"], "w") as out:
    out.write(repr(reply))
unknown = {"type": "Call", "rid": 2, "cid": conn.cid, "request": {"type": "NoSuchCall"}}
link.send(msgspec.msgpack.encode(unknown))
link.recv(1)  # until the relay closes the link
"""


async def test_bad_link_packets_end_the_store_process_not_the_relay(
    pool: Pool,
    relay: Any,
    agents: list[Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A call the relay cannot answer gets ``NoAnswer`` (that session ends), a packet that
    does not decode (a request of an unknown type) stops that store process, and the relay
    serves on."""
    from vpool.relay import storesupervisor

    out = tmp_path / "errors"
    monkeypatch.setenv("BAD_STORE_OUT", str(out))
    monkeypatch.setattr(storesupervisor, "COMMAND", [sys.executable, "-c", BAD_STORE_PROCESS])
    raw = await trio.open_tcp_stream(*relay.addr)
    await raw.send_all(b"VPSTORE\x01")
    with trio.fail_after(DEADLINE):
        assert await raw.receive_some(10) == b""  # its process stopped: the connection closes
    await raw.aclose()
    supervisor = relay.hub.store.supervisor
    await until(lambda: supervisor.current.proc.returncode is not None)
    assert supervisor.current.proc.returncode == 0
    assert out.read_text() == repr(
        Reply(rid=1, value=NoAnswer(error="the relay could not answer Commit"))
    )
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert [m.split(" (")[0] for m in logged] == [
        "store process: call Commit(manifest=b'not a manifest', directory='/', wait=1.0) failed",
        "store process: bad link packet",
    ], logged
    assert "NoSuchCall" in logged[1], logged
    caplog.clear()  # the errors above were expected
    agent = await FakeAgent.connect(pool, relay.addr, "agent-a")
    await agent.attach(pool, 1, 0, size=1, home=True)


async def test_write_error_mid_put_refuses_that_image_only(
    pool: Pool, relay: Any, tmp_path: Path, agents: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write of the image file that fails (here the store process may not write files past
    3 MiB: ``prlimit --fsize``, EFBIG), in the middle of a chunk's payload: the store reads
    past the rest of that payload and the image's other chunks, answers ``storage_error``,
    deletes the part file, and the connection goes on, bulk or not."""
    from vpool.relay import storesupervisor

    command = ["prlimit", f"--fsize={3 * MiB}", *storesupervisor.COMMAND]
    monkeypatch.setattr(storesupervisor, "COMMAND", command)
    conn = await store_conn(pool, relay.addr)
    data = image(1, 6 * MiB)
    for ckpt, bulk in ((1, True), (2, False)):
        # 4 MiB (the file's buffer) ends inside the 4th chunk.
        err = await put(conn, pool, 9, 0, ckpt, data, bulk=bulk, chunk=MiB + 5)
        assert isinstance(err, Error), err
        assert (err.code, err.job, err.rank) == ("storage_error", 9, 0)
        assert "File too large" in err.message
        assert ckpt_files(tmp_path / "relay", 9, 0) == []
        assert not relay.hub.store.uploading
    small = image(3, MiB + 7)
    assert await put(conn, pool, 9, 0, 3, small, bulk=True) == CkptStored(ckpt=3, retained=[3])
    got = await get(conn, pool, 9, 0, 3)
    assert not isinstance(got, Error) and got[1] == small
