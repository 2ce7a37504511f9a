"""The agent's connection to a relay's checkpoint store (docs/internals.md, "Checkpoints").

TCP + TLS 1.3 like a relay link, opened with ``Hello(role="store", token=agent token)``. One
image per connection at a time::

    put:  CkptPut, CkptChunk (payload) ..., CkptEnd  ->  CkptStored
    get:  CkptGet  ->  CkptInfo, CkptChunk (payload) ..., CkptEnd

An ``Error`` from the store becomes ``StoreError`` with its code (``fenced``, ``not_found``...).
Frames are made with ``protocol.framing``; they are read here, one at a time, the payload of a
``CkptChunk`` (the only message besides ``Data`` that carries one) included.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator
from types import TracebackType

import trio

from vpool import __version__
from vpool.protocol.api import RelayInfo
from vpool.protocol.errors import ProtocolError, RemoteProtocolError
from vpool.protocol.framing import PREFIX_SIZE, frame_parts, parse_prefix
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
)
from vpool.worker_agent.errors import AgentError

_READ = 1 << 20


class StoreError(AgentError):
    """The store refused (``code`` from its ``Error``), or the connection failed
    (``code`` = ``connection``)."""

    def __init__(self, message: str, code: str = "connection") -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class StoreConnection:
    """One open store connection. Use ``open_store`` to make one."""

    def __init__(self, stream: trio.SSLStream[trio.SocketStream], where: str, max_payload: int):
        self._stream = stream
        self._buf = bytearray()
        self.where = where
        self.max_payload = max_payload

    async def __aenter__(self) -> StoreConnection:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await trio.aclose_forcefully(self._stream)

    # -- frames -----------------------------------------------------------------------------

    async def send(self, msg: Message, payload: bytes | bytearray | memoryview = b"") -> None:
        parts = frame_parts(msg, payload)
        try:
            for part in parts:
                await self._stream.send_all(part)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise StoreError(f"connection to {self.where} broke: {exc}") from exc

    async def receive(self) -> tuple[Message, bytes]:
        """The next frame (message, payload); an ``Error`` frame raises ``StoreError``."""
        try:
            await self._fill(PREFIX_SIZE)
            header_len, payload_len = parse_prefix(
                self._buf[:PREFIX_SIZE], max_payload=self.max_payload
            )
            end = PREFIX_SIZE + header_len + payload_len
            await self._fill(end)
            msg = decode(self._buf[PREFIX_SIZE : PREFIX_SIZE + header_len])
            payload = bytes(self._buf[PREFIX_SIZE + header_len : end])
            del self._buf[:end]
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise StoreError(f"connection to {self.where} broke: {exc}") from exc
        except ProtocolError as exc:
            raise StoreError(f"{self.where} sent a bad frame: {exc}", exc.code) from exc
        if isinstance(msg, Error):
            raise StoreError(f"{self.where} refused: {msg.code}: {msg.message}", msg.code)
        if payload and not isinstance(msg, CkptChunk):
            raise StoreError(f"{self.where} sent a {type(msg).__name__} with a payload", "protocol")
        return msg, payload

    async def _fill(self, n: int) -> None:
        while len(self._buf) < n:
            chunk = await self._stream.receive_some(max(_READ, n - len(self._buf)))
            if not chunk:
                raise RemoteProtocolError(f"{self.where} closed the connection")
            self._buf += chunk

    async def _expect(self, kind: type[Message]) -> Message:
        msg, _ = await self.receive()
        if not isinstance(msg, kind):
            raise StoreError(
                f"{self.where} sent {type(msg).__name__}, expected {kind.__name__}", "protocol"
            )
        return msg

    # -- put --------------------------------------------------------------------------------

    async def put_begin(self, put: CkptPut) -> None:
        await self.send(put)

    async def put_chunk(self, ckpt: int, data: bytes | bytearray | memoryview) -> None:
        await self.send(CkptChunk(ckpt=ckpt), data)

    async def put_end(self, ckpt: int, size: int, sha256: bytes) -> CkptStored:
        """Send ``CkptEnd`` and wait for the store's ``CkptStored``."""
        await self.send(CkptEnd(ckpt=ckpt, size=size, sha256=sha256))
        stored = await self._expect(CkptStored)
        assert isinstance(stored, CkptStored)
        if stored.ckpt != ckpt:
            raise StoreError(f"{self.where} stored image {stored.ckpt}, not {ckpt}", "protocol")
        return stored

    # -- get --------------------------------------------------------------------------------

    async def get(self, token: str, ckpt: int) -> tuple[CkptInfo, AsyncIterator[bytes]]:
        """Ask for image ``ckpt``; its ``CkptInfo`` and an iterator over its bytes, which
        raises ``StoreError`` unless exactly ``info.size`` bytes and a matching ``CkptEnd``
        arrive."""
        await self.send(CkptGet(token=token, ckpt=ckpt))
        info = await self._expect(CkptInfo)
        assert isinstance(info, CkptInfo)
        if info.ckpt != ckpt:
            raise StoreError(f"{self.where} sent image {info.ckpt}, not {ckpt}", "protocol")
        return info, self._chunks(info)

    async def _chunks(self, info: CkptInfo) -> AsyncIterator[bytes]:
        got = 0
        while True:
            msg, payload = await self.receive()
            if isinstance(msg, CkptChunk) and msg.ckpt == info.ckpt:
                got += len(payload)
                if got > info.size:
                    raise StoreError(f"{self.where} sent more than {info.size} bytes", "protocol")
                yield payload
            elif isinstance(msg, CkptEnd) and msg.ckpt == info.ckpt:
                if got != info.size or msg.size != info.size or msg.sha256 != info.sha256:
                    raise StoreError(
                        f"{self.where} ended image {info.ckpt} after {got} of {info.size} "
                        "bytes or with another checksum",
                        "protocol",
                    )
                return
            else:
                raise StoreError(
                    f"{self.where} sent {type(msg).__name__} inside image {info.ckpt}", "protocol"
                )


async def open_store(
    info: RelayInfo,
    *,
    ssl_context: ssl.SSLContext,
    token: str,
    max_payload: int,
    seconds: float = 15.0,
) -> StoreConnection:
    """Connect to the store of relay ``info`` within ``seconds`` (raises ``StoreError``)."""
    where = f"the checkpoint store of relay {info.name or info.host} ({info.host}:{info.port})"
    try:
        with trio.fail_after(seconds):
            tcp = await trio.open_tcp_stream(info.host, info.port)
            stream = trio.SSLStream(tcp, ssl_context, server_hostname=info.host)
            conn = StoreConnection(stream, where, max_payload)
            try:
                await stream.do_handshake()
                await conn.send(
                    Hello(
                        version=PROTOCOL_VERSION,
                        role="store",
                        token=token,
                        software=f"vpool-agent {__version__}",
                    )
                )
                welcome = await conn._expect(Welcome)
                assert isinstance(welcome, Welcome)
                if welcome.version != PROTOCOL_VERSION:
                    raise StoreError(
                        f"{where} speaks protocol {welcome.version}, this agent {PROTOCOL_VERSION}",
                        "version",
                    )
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
    except trio.TooSlowError as exc:
        raise StoreError(f"{where} did not answer within {seconds:g} s") from exc
    except (OSError, trio.BrokenResourceError, ssl.SSLError) as exc:
        raise StoreError(f"cannot connect to {where}: {exc}") from exc
    return conn
