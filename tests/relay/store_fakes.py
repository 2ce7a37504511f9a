"""The store client's side of the wire, for the relay's checkpoint store tests: a blocking
client (as the agent's is) over real TLS, its trio wrapper, and puts and gets made with it.
Loaded by ``conftest`` as the module ``store_fakes`` (see ``relay_fakes``)."""

from __future__ import annotations

import hashlib
import os
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
from cryptography.hazmat.primitives.poly1305 import Poly1305
from relay_fakes import DEADLINE, FakeAgent, Pool

from vpool.protocol.api import RelayInfo
from vpool.protocol.ckptdigest import image_digest
from vpool.protocol.framing import PREFIX, PREFIX_SIZE, raw_frame_parts
from vpool.protocol.local import local_socket_name
from vpool.protocol.messages import (
    PROTOCOL_VERSION,
    CkptChunk,
    CkptEnd,
    CkptGet,
    CkptInfo,
    CkptPut,
    CkptStored,
    Error,
    Hello,
    Message,
    Welcome,
    decode,
    encode,
)
from vpool.relay.ckptstore import STORE_PREAMBLE
from vpool.worker_agent import store_client
from vpool.worker_agent.store_client import StoreConnection

MiB = 1024 * 1024
# A transport MAC key for puts that never reach their CkptEnd (``put`` draws its own).
MAC_KEY = bytes(range(32))


class BlockingStore:
    """The store client's side of the wire, blocking as the agent's is: TCP, the preamble, TLS
    with the pool's CA (none on an ``insecure_tcp`` relay), then frames. ``framing``'s encoder
    and decoder admit payloads on ``Data`` only, so chunk frames are put together and taken
    apart here."""

    def __init__(
        self,
        addr: tuple[str, int],
        ssl_context: ssl.SSLContext | None,
        *,
        preamble: bytes = STORE_PREAMBLE,
        local: bool = False,
    ) -> None:
        if local:  # the relay's same-host socket (``protocol.local``)
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(DEADLINE)
            sock.connect(local_socket_name(addr[1]))
        else:
            sock = socket.create_connection(addr, timeout=DEADLINE)
        sock.sendall(preamble)
        if ssl_context is not None:
            try:
                sock = ssl_context.wrap_socket(sock, server_hostname=addr[0])
            except BaseException:
                sock.close()
                raise
        self.sock = sock
        self.buf = bytearray()
        # The TCP stream beneath TLS, for bulk payloads (``send_bulk``).
        self.raw = socket.socket(fileno=os.dup(sock.fileno()))
        self.raw.settimeout(DEADLINE)

    def send(self, msg: Message, payload: bytes = b"") -> None:
        self.sock.sendall(b"".join(raw_frame_parts(encode(msg), payload)))

    def send_bulk(self, msg: Message, payload: bytes) -> None:
        """A frame whose payload goes beneath TLS (``CkptPut.bulk``)."""
        head, body = raw_frame_parts(encode(msg), payload)
        self.sock.sendall(head)
        self.raw.sendall(body)

    def recv(self) -> tuple[Message, bytes]:
        """The next frame; EOFError once the relay closed the connection."""
        buf = self.buf
        while True:
            if len(buf) >= PREFIX_SIZE:
                hlen, plen = PREFIX.unpack_from(buf)
                end = PREFIX_SIZE + hlen + plen
                if len(buf) >= end:
                    msg = decode(bytes(buf[PREFIX_SIZE : PREFIX_SIZE + hlen]))
                    payload = bytes(buf[PREFIX_SIZE + hlen : end])
                    del buf[:end]
                    return msg, payload
            try:
                data = self.sock.recv(1 << 20)
            except (ConnectionError, ssl.SSLError) as exc:
                raise EOFError(f"connection broken: {exc}") from exc
            if not data:
                raise EOFError("connection closed")
            buf += data

    def close(self) -> None:
        self.sock.close()
        self.raw.close()


class StoreClient:
    """A ``BlockingStore`` for trio tests: the relay runs in the test's own trio loop, so each
    blocking call runs in a thread (the socket's timeout, DEADLINE, bounds it)."""

    def __init__(self, client: BlockingStore, agent: str) -> None:
        self.client = client
        self.agent = agent
        self.welcome: Welcome | None = None

    async def send(self, msg: Message, payload: bytes = b"") -> None:
        await trio.to_thread.run_sync(self.client.send, msg, payload)

    async def send_bulk(self, msg: Message, payload: bytes) -> None:
        await trio.to_thread.run_sync(self.client.send_bulk, msg, payload)

    async def recv(self) -> tuple[Message, bytes]:
        return await trio.to_thread.run_sync(self.client.recv)

    async def expect(self, kind: type[Any]) -> Any:
        msg, _ = await self.recv()
        assert isinstance(msg, kind), f"expected {kind.__name__}, got {msg!r}"
        return msg

    async def expect_error(self, code: str) -> Error:
        """An Error with ``code`` about the connection, then the connection's end."""
        err = await self.expect(Error)
        assert err.code == code, err
        with pytest.raises(EOFError):
            await self.recv()
        return err

    async def aclose(self) -> None:
        self.client.close()


async def open_store(
    addr: tuple[str, int], ssl_context: ssl.SSLContext | None, **kw: Any
) -> BlockingStore:
    return await trio.to_thread.run_sync(lambda: BlockingStore(addr, ssl_context, **kw))


async def store_conn(
    pool: Pool,
    addr: tuple[str, int],
    agent: str = "agent-1",
    *,
    tls: bool = True,
    local: bool = False,
) -> StoreClient:
    ssl_context = pool.client_ssl if tls else None
    conn = StoreClient(await open_store(addr, ssl_context, local=local), agent)
    FakeAgent.opened.append(conn)  # type: ignore[arg-type]
    await conn.send(Hello(version=PROTOCOL_VERSION, role="store", token=pool.agent_token(agent)))
    conn.welcome = await conn.expect(Welcome)
    return conn


async def until(check: Callable[[], bool]) -> None:
    """Poll ``check`` (state the relay changes in the background) up to DEADLINE."""
    with trio.fail_after(DEADLINE):
        for _ in range(int(DEADLINE / 0.01)):
            if check():
                return
            await trio.sleep(0.01)
    raise AssertionError("the relay did not get there in time")


def image(ckpt: int, size: int) -> bytes:
    return hashlib.sha256(b"%d" % ckpt).digest() * (size // 32) + os.urandom(size % 32)


async def put(
    conn: StoreClient,
    pool: Pool,
    job: int,
    rank: int,
    ckpt: int,
    data: bytes,
    *,
    size: int = 2,
    incarnation: int = 1,
    received: dict[int, int] | None = None,
    dets: int = 0,
    digest: bytes | None = None,
    mac_key: bytes | None = None,
    mac: bytes | None = None,
    bulk: bool = False,
    sent: bytes | None = None,
    chunk: int = MiB,
) -> Any:
    """Upload one image in ``chunk``-byte chunks (``bulk``: their payloads beneath TLS;
    ``sent``: bytes sent in place of ``data``, which the digest and the transport MAC cover,
    as when they are changed on the way; ``mac_key`` b"": none, else a fresh one); the
    store's answer (CkptStored or Error)."""
    token = pool.rank_token(job, rank, agent=conn.agent, size=size, incarnation=incarnation)
    mac_key = os.urandom(32) if mac_key is None else mac_key
    await conn.send(
        CkptPut(
            token=token,
            ckpt=ckpt,
            received=received or {},
            dets=dets,
            fingerprint="fp-1",
            meta=b"manifest",
            bulk=bulk,
            mac_key=mac_key,
        )
    )
    wire = data if sent is None else sent
    send = conn.send_bulk if bulk else conn.send
    for pos in range(0, len(wire), chunk):
        await send(CkptChunk(ckpt=ckpt), wire[pos : pos + chunk])
    digest = image_digest(data) if digest is None else digest
    if mac is None:
        mac = Poly1305.generate_tag(mac_key, data) if mac_key else b""
    await conn.send(CkptEnd(ckpt=ckpt, size=len(data), digest=digest, mac=mac))
    msg, _ = await conn.recv()
    return msg


async def get(
    conn: StoreClient, pool: Pool, job: int, rank: int, ckpt: int, *, incarnation: int = 2
) -> tuple[CkptInfo, bytes] | Error:
    """Fetch one image as a restoring incarnation would; its info and bytes, or the Error."""
    token = pool.rank_token(job, rank, agent=conn.agent, size=2, incarnation=incarnation)
    await conn.send(CkptGet(token=token, ckpt=ckpt))
    info, _ = await conn.recv()
    if isinstance(info, Error):
        return info
    assert isinstance(info, CkptInfo), info
    parts = []
    while True:
        msg, payload = await conn.recv()
        if isinstance(msg, CkptEnd):
            break
        assert isinstance(msg, CkptChunk) and msg.ckpt == ckpt, msg
        assert len(payload) <= MiB
        parts.append(payload)
    data = b"".join(parts)
    assert (msg.size, msg.digest) == (len(data), image_digest(data))
    assert (info.size, info.digest) == (msg.size, msg.digest)
    return info, data


def ckpt_files(relay_dir: Path, job: int, rank: int) -> list[str]:
    d = relay_dir / "jobs" / str(job) / str(rank) / "ckpt"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def agent_put(
    info: RelayInfo, pool: Pool, data: bytes, ckpt: int, *, local: bool = True
) -> tuple[StoreConnection, CkptStored, bytes]:
    """One put in 1 MiB pieces with the agent's store client (blocking: run it in a thread),
    and the image got back: (the closed connection, for its ``bulk`` and ``local``, the
    store's answer, the bytes)."""
    token = pool.rank_token(7, 1, agent="agent-1", size=2)
    with store_client.open_store(
        info,
        ssl_context=pool.client_ssl,
        token=pool.agent_token("agent-1"),
        max_payload=MiB,
        local=local,
    ) as conn:
        conn.put_begin(CkptPut(token, ckpt, {}, 0, "fp", b"meta"))
        for pos in range(0, len(data), MiB):
            conn.put_chunk(ckpt, data[pos : pos + MiB])
        stored = conn.put_end(ckpt, len(data), image_digest(data))
        restoring = pool.rank_token(7, 1, agent="agent-1", size=2, incarnation=2)
        _, chunks = conn.get(restoring, ckpt)
        return conn, stored, b"".join(chunks)
