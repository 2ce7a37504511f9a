"""Bulk puts: an image's chunk payloads beneath TLS, their prefixes and headers and everything
else through it (``relay.ckptstore``, "Bulk payloads"); the agent's store client uses them when
the store offers them, and not otherwise."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio
from relay_fakes import Pool, start_relay
from store_fakes import MiB, agent_put, ckpt_files, get, image, put, store_conn

from vpool.protocol.api import RelayInfo
from vpool.protocol.ckptdigest import image_digest
from vpool.protocol.messages import CkptPut, CkptStored, Error
from vpool.worker_agent import ckpt_image

pytestmark = pytest.mark.large


async def test_bulk_put_round_trip(pool: Pool, relay: Any, tmp_path: Path, agents: object) -> None:
    conn = await store_conn(pool, relay.addr)
    assert conn.welcome is not None and conn.welcome.bulk
    data = image(1, 5 * MiB + 12345)
    assert await put(conn, pool, 3, 1, 1, data, bulk=True) == CkptStored(ckpt=1, retained=[1])
    # Bulk and TLS-borne puts mix on one connection.
    data2 = image(2, 2 * MiB + 7)
    assert await put(conn, pool, 3, 1, 2, data2) == CkptStored(ckpt=2, retained=[2, 1])
    for ckpt, want in ((1, data), (2, data2)):
        got = await get(conn, pool, 3, 1, ckpt)
        assert not isinstance(got, Error) and got[1] == want
    stored = tmp_path / "relay" / "jobs" / "3" / "1" / "ckpt" / "1.img"
    assert stored.read_bytes() == data
    data3 = image(3, MiB // 2)  # smaller than one chunk
    assert await put(conn, pool, 3, 1, 3, data3, bulk=True) == CkptStored(ckpt=3, retained=[3, 2])
    got = await get(conn, pool, 3, 1, 3)
    assert not isinstance(got, Error) and got[1] == data3


async def test_bulk_bytes_changed_on_the_way_are_corrupt(
    pool: Pool, relay: Any, tmp_path: Path, agents: object
) -> None:
    """Beneath TLS nothing checks the bytes as they come: the digest in CkptEnd (through TLS)
    does, and nothing is committed; the connection goes on."""
    conn = await store_conn(pool, relay.addr)
    data = image(4, 3 * MiB)
    changed = bytearray(data)
    changed[2 * MiB + 100] ^= 0x40
    err = await put(conn, pool, 4, 0, 4, data, bulk=True, sent=bytes(changed))
    assert isinstance(err, Error) and (err.code, err.job, err.rank) == ("corrupt", 4, 0)
    assert ckpt_files(tmp_path / "relay", 4, 0) == []
    assert await put(conn, pool, 4, 0, 4, data, bulk=True) == CkptStored(ckpt=4, retained=[4])


async def test_refused_bulk_put_drops_its_payloads_from_beneath(
    pool: Pool, relay: Any, agents: object
) -> None:
    """A refused put's chunks still come beneath TLS: the store reads them from there to drop
    them, so the frames after them are read where they are."""
    conn = await store_conn(pool, relay.addr)
    data = image(5, 2 * MiB + 3)
    assert await put(conn, pool, 5, 0, 5, data, bulk=True) == CkptStored(ckpt=5, retained=[5])
    err = await put(conn, pool, 5, 0, 5, data, bulk=True)  # not newer than the newest
    assert isinstance(err, Error) and err.code == "stale_ckpt"
    assert await put(conn, pool, 5, 0, 6, data, bulk=True) == CkptStored(ckpt=6, retained=[6, 5])


def _agent_put(info: RelayInfo, pool: Pool, data: bytes, ckpt: int) -> tuple[bool, Any, bytes]:
    """The agent's store client (``agent_put``): (bulk?, stored, bytes back)."""
    conn, stored, back = agent_put(info, pool, data, ckpt)
    return conn.bulk, stored, back


async def test_agent_sends_bulk_when_the_store_offers_it(
    pool: Pool, relay: Any, agents: object, nursery: trio.Nursery, tmp_path: Path
) -> None:
    info = RelayInfo(name="r", host=relay.addr[0], port=relay.addr[1])
    data = image(8, 3 * MiB + 99)
    bulk, stored, back = await trio.to_thread.run_sync(_agent_put, info, pool, data, 1)
    assert (bulk, stored, back == data) == (True, CkptStored(ckpt=1, retained=[1]), True)
    # A store that does not offer it (``store_bulk`` off, or an older relay) gets every byte
    # through TLS.
    settings = pool.settings(tmp_path / "relay2", store_bulk=False)
    plain = await start_relay(nursery, settings, signing_key=pool.key.public_key())
    info = RelayInfo(name="r2", host=plain.addr[0], port=plain.addr[1])
    bulk, stored, back = await trio.to_thread.run_sync(_agent_put, info, pool, data, 2)
    assert (bulk, stored, back == data) == (False, CkptStored(ckpt=2, retained=[2]), True)


async def test_changed_ciphertext_keeps_the_digest_and_fails_the_mac(
    pool: Pool, relay: Any, tmp_path: Path, agents: object
) -> None:
    """A real image with a byte of ciphertext changed on the way has the same digest (only the
    frames' headers and tags are digested): the transport MAC is what refuses it. A MAC that
    does not match the bytes is refused the same way; a put without a MAC key ends the
    connection."""
    writer = ckpt_image.ImageWriter(bytes(32), job=6, rank=0, ckpt=1)
    data = b"".join(writer.seal([os.urandom(2 * MiB)]))  # incompressible: 2 raw frames
    changed = bytearray(data)
    changed[MiB + 1000] ^= 0x10
    assert image_digest(bytes(changed)) == image_digest(data)
    conn = await store_conn(pool, relay.addr)
    for bulk in (True, False):
        err = await put(conn, pool, 6, 0, 1, data, bulk=bulk, sent=bytes(changed))
        assert isinstance(err, Error) and (err.code, err.rank) == ("corrupt", 0), err
        assert "transport MAC" in err.message
        err = await put(conn, pool, 6, 0, 1, data, bulk=bulk, mac=bytes(16))
        assert isinstance(err, Error) and err.code == "corrupt"
    assert ckpt_files(tmp_path / "relay", 6, 0) == []
    assert await put(conn, pool, 6, 0, 1, data, bulk=True) == CkptStored(ckpt=1, retained=[1])
    got = await get(conn, pool, 6, 0, 1)
    assert not isinstance(got, Error) and got[1] == data and got[0].digest == writer.digest
    token = pool.rank_token(6, 0, agent=conn.agent, size=2)
    await conn.send(CkptPut(token=token, ckpt=2, received={}, dets=0, fingerprint="fp"))
    err = await conn.expect_error("bad_frame")
    assert err.rank == -1 and "mac_key" in err.message
