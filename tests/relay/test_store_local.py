"""The relay's same-host socket (``protocol.local``): the store served on it as on TCP, puts
without a transport MAC accepted there and only there, the agent's store client choosing it
for a relay at a loopback address, and agent links served on it too."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest
import trio
from relay_fakes import FakeAgent, Pool, start_relay
from store_fakes import MiB, agent_put, ckpt_files, get, image, put, store_conn

from vpool.protocol.api import RelayInfo
from vpool.protocol.local import is_loopback, local_socket_name
from vpool.protocol.messages import CkptPut, CkptStored, Error


@pytest.mark.large
async def test_put_without_mac_on_the_local_socket_only(
    pool: Pool, relay: Any, tmp_path: Path, agents: object
) -> None:
    local = await store_conn(pool, relay.addr, local=True)
    assert local.welcome is not None and local.welcome.bulk
    data = image(1, 3 * MiB + 5)
    for ckpt, bulk in ((1, True), (2, False)):
        stored = await put(local, pool, 3, 0, ckpt, data, bulk=bulk, mac_key=b"")
        assert isinstance(stored, CkptStored) and stored.ckpt == ckpt, stored
        got = await get(local, pool, 3, 0, ckpt)
        assert not isinstance(got, Error) and got[1] == data
    # A MAC key given there is still checked.
    err = await put(local, pool, 3, 0, 3, data, bulk=True, mac=bytes(16))
    assert isinstance(err, Error) and err.code == "corrupt" and "transport MAC" in err.message
    # The digest is checked without a MAC all the same.
    changed = bytearray(data)
    changed[10] ^= 1  # in the image's skeleton: these bytes are digested
    err = await put(local, pool, 3, 0, 3, data, bulk=True, mac_key=b"", sent=bytes(changed))
    assert isinstance(err, Error) and err.code == "corrupt", err
    assert ckpt_files(tmp_path / "relay", 3, 0) == ["1.img", "1.json", "2.img", "2.json"]
    # Over TCP a put without a key ends the connection.
    tcp = await store_conn(pool, relay.addr)
    token = pool.rank_token(3, 0, agent=tcp.agent, size=2)
    await tcp.send(CkptPut(token=token, ckpt=4, received={}, dets=0, fingerprint="fp"))
    err = await tcp.expect_error("bad_frame")
    assert "mac_key" in err.message


async def test_relay_without_local_socket(
    pool: Pool, nursery: trio.Nursery, tmp_path: Path
) -> None:
    settings = pool.settings(tmp_path / "relay2", local_socket=False)
    plain = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            probe.connect(local_socket_name(plain.addr[1]))
        except ConnectionRefusedError:
            pass
        else:
            raise AssertionError("the relay listens on its same-host socket with it off")
    finally:
        probe.close()


def _agent_put(
    info: RelayInfo, pool: Pool, data: bytes, ckpt: int, local: bool
) -> tuple[bool, CkptStored, bytes]:
    """The agent's store client (``agent_put``): (same-host link?, stored, bytes back)."""
    conn, stored, back = agent_put(info, pool, data, ckpt, local=local)
    assert conn.bulk
    return conn.local, stored, back


@pytest.mark.large
async def test_agent_client_takes_the_local_socket_of_a_loopback_relay(
    pool: Pool, relay: Any, nursery: trio.Nursery, tmp_path: Path, agents: object
) -> None:
    data = image(8, 2 * MiB + 99)
    info = RelayInfo(name="r", host=relay.addr[0], port=relay.addr[1])
    for ckpt, local in ((1, True), (2, False)):
        how, stored, back = await trio.to_thread.run_sync(_agent_put, info, pool, data, ckpt, local)
        assert how is local and stored.ckpt == ckpt and back == data
    # "localhost" is a loopback address too.
    named = RelayInfo(name="r", host="localhost", port=relay.addr[1])
    how, stored, back = await trio.to_thread.run_sync(_agent_put, named, pool, data, 3, True)
    assert how is True and back == data
    # A relay with no same-host socket is reached through TCP.
    settings = pool.settings(tmp_path / "relay2", local_socket=False)
    plain = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    info = RelayInfo(name="r2", host=plain.addr[0], port=plain.addr[1])
    how, stored, back = await trio.to_thread.run_sync(_agent_put, info, pool, data, 4, True)
    assert how is False and stored.ckpt == 4 and back == data


def test_is_loopback() -> None:
    for host in ("127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("10.0.0.1", "192.168.1.2", "example.org", "::", "0.0.0.0", ""):
        assert not is_loopback(host), host


async def test_agent_link_on_the_local_socket(pool: Pool, relay: Any, agents: object) -> None:
    """An agent connection on the same-host socket is served as on TCP: messages deposited
    there reach a rank attached over TCP, and the other way round."""
    here = await FakeAgent.connect(pool, relay.addr, "agent-h", local=True)
    assert here.welcome is not None
    there = await FakeAgent.connect(pool, relay.addr, "agent-t")
    await here.attach(pool, 9, 0, size=2, home=True)
    await there.attach(pool, 9, 1, size=2, home=True)
    await here.deposit(9, 0, 1, 1, b"over unix")
    await here.acks_until(9, 0, 1, 1)
    await there.deposit(9, 1, 0, 1, b"over tcp")
    _, got = await there.next_data()
    assert got == b"over unix"
    _, got = await here.next_data()
    assert got == b"over tcp"
