"""The agent's connection to a relay's checkpoint store (docs/internals.md, "Checkpoints").

Blocking, for one worker thread: a checkpoint's upload packs, encrypts and sends its image in
the same thread, with no hand-over per piece, and a restore unpacks what it reads there too.
(Through trio's ``SSLStream`` the relay spent 0.35 s of CPU per 200 MB receiving, one await
per 16 KiB TLS record; a blocking TLS socket 0.10 s. The agent's side gains less but drops
the hand-over of every megabyte between threads.)

A store connection goes to the relay's usual address (its same-host socket for a relay at a
loopback address, when it has one: ``protocol.local``). It sends ``STORE_PREAMBLE`` in plaintext
first, then TLS 1.3 as for a relay link, then ``Hello(role="store", token=agent token)``.
One image per connection at a time::

    put:  CkptPut, CkptChunk (payload) ..., CkptEnd  ->  CkptStored
    get:  CkptGet  ->  CkptInfo, CkptChunk (payload) ..., CkptEnd

Frames are made with ``protocol.framing`` and read here. An ``Error`` from the store becomes
``StoreError`` with its code (``fenced``, ``not_found``...). ``run_in_thread`` runs such work
from trio: a cancellation shuts the connection down, so the thread returns at once.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from functools import partial
from types import TracebackType
from typing import TypeVar

import msgspec
import outcome
import trio
from cryptography.hazmat.primitives.poly1305 import Poly1305

from vpool import __version__
from vpool.niceness import run_niced
from vpool.protocol.api import RelayInfo
from vpool.protocol.ckptdigest import MAC_KEY
from vpool.protocol.errors import ErrorCode, ProtocolError
from vpool.protocol.framing import PREFIX_SIZE, FrameScanner, Large, Small, decode_head, frame_parts
from vpool.protocol.local import LOCAL_SNDBUF, is_loopback, local_socket_name
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
)
from vpool.reasons import describe
from vpool.worker_agent.errors import AgentError

# Sent in plaintext before TLS: the relay serves such a connection as a store (relay/ckptstore.py
# holds the same bytes).
STORE_PREAMBLE = b"VPSTORE\x01"
IDLE_TIMEOUT = 60.0  # s any one send or receive may block
_READ = 1 << 20
T = TypeVar("T")
logger = logging.getLogger(__name__)


class StoreError(AgentError):
    """The store refused (``code`` from its ``Error``), or the connection failed
    (``code`` = ``link_broken``)."""

    def __init__(self, message: str, code: str = ErrorCode.LINK_BROKEN) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Aborter:
    """Lets trio end a worker thread's store I/O: ``abort`` shuts down the socket the thread
    registered (or the one it registers next), so whatever it blocks in fails at once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self.aborted = False

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._sock = sock
            if not self.aborted:
                return
        _shutdown(sock)
        raise StoreError("cancelled")

    def abort(self) -> None:
        with self._lock:
            self.aborted = True
            sock = self._sock
        if sock is not None:
            _shutdown(sock)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


async def run_in_thread(
    work: Callable[[Aborter], T], limiter: trio.CapacityLimiter | None = None, *, nice: int = 0
) -> T:
    """``work(aborter)`` in a worker thread. When the caller is cancelled the connection is
    shut down (``Aborter.abort``) and the thread waited for, so none outlives the call.

    ``nice`` > 0: in a thread of its own that much nicer (``vpool.niceness.run_niced``), not
    one of trio's, so ``work`` reaches the loop with ``trio.from_thread.*(...,
    trio_token=...)``."""
    aborter = Aborter()

    async def on_cancel() -> None:
        try:
            await trio.sleep_forever()
        finally:
            aborter.abort()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(on_cancel)
        # Captured, so that an error of ``work`` leaves this nursery as itself, not inside an
        # exception group; a cancellation still leaves it as one (the cancelled scope's).
        result = await outcome.acapture(
            trio.to_thread.run_sync, run_niced, partial(work, aborter), nice, limiter=limiter
        )
        nursery.cancel_scope.cancel()
    return result.unwrap()


class StoreConnection:
    """One open store connection (``open_store``); use it from one thread."""

    def __init__(
        self, sock: socket.socket, where: str, max_payload: int, *, local: bool = False
    ) -> None:
        self._sock = sock
        # A same-host link (``protocol.local``): puts need no transport MAC.
        self.local = local
        self._scanner = FrameScanner(max_payload=max_payload)
        self.where = where
        self.max_payload = max_payload
        # The TCP stream beneath TLS, for the payloads of bulk puts (``enable_bulk``).
        self._raw: socket.socket | None = None
        self._bulk = -1  # the ckpt id of the put in progress that sends its payloads beneath
        self._mac: Poly1305 | None = None  # the transport MAC of the put in progress

    def __enter__(self) -> StoreConnection:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        for sock in (self._sock, self._raw):
            try:
                if sock is not None:
                    sock.close()
            except OSError:
                pass

    def enable_bulk(self) -> None:
        """The store said ``Welcome.bulk``: puts send their payloads beneath TLS (the image is
        sealed already; ``relay.ckptstore``, "Bulk payloads")."""
        self._raw = socket.socket(fileno=os.dup(self._sock.fileno()))
        self._raw.settimeout(self._sock.gettimeout())

    @property
    def bulk(self) -> bool:
        return self._raw is not None

    # -- frames -----------------------------------------------------------------------------

    def send(self, msg: Message, payload: bytes | bytearray | memoryview = b"") -> None:
        try:
            for part in frame_parts(msg, payload):
                self._sock.sendall(part)
        except (OSError, ValueError) as exc:
            raise StoreError(f"connection to {self.where} broke: {describe(exc)}") from exc

    def receive(self, timeout: float = IDLE_TIMEOUT) -> tuple[Message, bytes]:
        """The next frame (message, payload); an ``Error`` frame raises ``StoreError``."""
        try:
            self._sock.settimeout(timeout)
            msg, payload = self._next()
        except TimeoutError as exc:
            raise StoreError(f"{self.where} sent nothing for {timeout:g} s") from exc
        except (OSError, ValueError) as exc:
            raise StoreError(f"connection to {self.where} broke: {describe(exc)}") from exc
        except ProtocolError as exc:
            raise StoreError(f"{self.where} sent a bad frame: {exc}", exc.code) from exc
        finally:
            self._settimeout(IDLE_TIMEOUT)
        if isinstance(msg, Error):
            raise StoreError(f"{self.where} refused: {msg.code}: {msg.message}", msg.code)
        if payload and not isinstance(msg, CkptChunk):
            raise StoreError(
                f"{self.where} sent a {type(msg).__name__} with a payload",
                ErrorCode.UNEXPECTED_MESSAGE,
            )
        return msg, payload

    def _settimeout(self, seconds: float) -> None:
        try:
            self._sock.settimeout(seconds)
        except OSError:
            pass  # closed meanwhile (aborted): the next call says so

    def _next(self) -> tuple[Message, bytes | bytearray]:
        """The next whole frame off the socket: a large payload is received into its own
        buffer."""
        scanner = self._scanner
        msg: Message | None = None
        while True:
            event = scanner.next_event()
            if event is None:
                n = self._sock.recv_into(scanner.get_buffer())
                if not n:
                    scanner.eof()
                    raise ConnectionError(f"{self.where} closed the connection")
                scanner.buffer_updated(n)
            elif type(event) is Small:
                head = PREFIX_SIZE + event.header_len
                msg = decode_head(event.frame, event.header_len, event.payload_len)
                return msg, bytes(event.frame[head:])
            elif type(event) is Large:
                msg = decode_head(event.head, event.header_len, event.payload_len)
                scanner.claim(bytearray(event.payload_len))
            else:
                assert msg is not None and isinstance(event.target, bytearray)
                return msg, event.target

    def _expect(self, kind: type[Message], timeout: float = IDLE_TIMEOUT) -> Message:
        msg, _ = self.receive(timeout)
        if not isinstance(msg, kind):
            raise StoreError(
                f"{self.where} sent {type(msg).__name__}, expected {kind.__name__}",
                ErrorCode.UNEXPECTED_MESSAGE,
            )
        return msg

    # -- put --------------------------------------------------------------------------------

    def put_begin(self, put: CkptPut) -> None:
        # The connection decides, not the caller: the store reads the payloads where the put
        # says they are.
        # A fresh one-time key for the transport MAC (``protocol.ckptdigest``): never reused.
        # None on a same-host link, where nothing can change the bytes on their way.
        key = b"" if self.local else secrets.token_bytes(MAC_KEY)
        put = msgspec.structs.replace(put, bulk=self._raw is not None, mac_key=key)
        self._bulk = put.ckpt if put.bulk else -1
        self._mac = Poly1305(key) if key else None
        self.send(put)

    def put_chunk(self, ckpt: int, data: bytes | bytearray | memoryview) -> None:
        if self._mac is not None:
            self._mac.update(data)
        raw = self._raw
        if ckpt != self._bulk or raw is None or not data:  # an empty payload has no bytes
            self.send(CkptChunk(ckpt=ckpt), data)
            return
        head, payload = frame_parts(CkptChunk(ckpt=ckpt), data)
        try:
            self._sock.sendall(head)
            raw.sendall(payload)
        except (OSError, ValueError) as exc:
            raise StoreError(f"connection to {self.where} broke: {describe(exc)}") from exc

    def put_end(
        self, ckpt: int, size: int, digest: bytes, timeout: float = IDLE_TIMEOUT
    ) -> CkptStored:
        """Send ``CkptEnd`` (with the put's transport MAC) and wait (``timeout`` s at most)
        for the store's ``CkptStored``."""
        mac, self._mac = self._mac, None
        tag = mac.finalize() if mac is not None else b""
        self.send(CkptEnd(ckpt=ckpt, size=size, digest=digest, mac=tag))
        stored = self._expect(CkptStored, timeout)
        assert isinstance(stored, CkptStored)
        if stored.ckpt != ckpt:
            raise StoreError(
                f"{self.where} stored image {stored.ckpt}, not {ckpt}", ErrorCode.UNEXPECTED_MESSAGE
            )
        return stored

    # -- get --------------------------------------------------------------------------------

    def get(self, token: str, ckpt: int) -> tuple[CkptInfo, Iterator[bytes]]:
        """Ask for image ``ckpt``; its ``CkptInfo`` and an iterator over its bytes, which
        raises ``StoreError`` unless exactly ``info.size`` bytes and a matching ``CkptEnd``
        arrive."""
        self.send(CkptGet(token=token, ckpt=ckpt))
        info = self._expect(CkptInfo)
        assert isinstance(info, CkptInfo)
        if info.ckpt != ckpt:
            raise StoreError(
                f"{self.where} sent image {info.ckpt}, not {ckpt}", ErrorCode.UNEXPECTED_MESSAGE
            )
        return info, self._chunks(info)

    def _chunks(self, info: CkptInfo) -> Iterator[bytes]:
        got = 0
        while True:
            msg, payload = self.receive()
            if isinstance(msg, CkptChunk) and msg.ckpt == info.ckpt:
                got += len(payload)
                if got > info.size:
                    raise StoreError(
                        f"{self.where} sent more than {info.size} bytes",
                        ErrorCode.UNEXPECTED_MESSAGE,
                    )
                yield payload
            elif isinstance(msg, CkptEnd) and msg.ckpt == info.ckpt:
                if got != info.size or msg.size != info.size or msg.digest != info.digest:
                    raise StoreError(
                        f"{self.where} ended image {info.ckpt} after {got} of {info.size} "
                        "bytes or with another digest",
                        ErrorCode.UNEXPECTED_MESSAGE,
                    )
                return
            else:
                raise StoreError(
                    f"{self.where} sent {type(msg).__name__} inside image {info.ckpt}",
                    ErrorCode.UNEXPECTED_MESSAGE,
                )


def open_store(
    info: RelayInfo,
    *,
    ssl_context: ssl.SSLContext,
    token: str,
    max_payload: int,
    aborter: Aborter | None = None,
    seconds: float = 15.0,
    local: bool = True,
) -> StoreConnection:
    """Connect to the store of relay ``info`` within ``seconds`` (blocking; raises
    ``StoreError``). With ``local``, a relay at a loopback address is reached through its
    same-host socket when it has one (``protocol.local``), else through TCP."""
    where = f"the checkpoint store of relay {info.name or info.host} ({info.host}:{info.port})"
    raw = _connect_local(info, seconds) if local else None
    if raw is None:
        try:
            raw = socket.create_connection((info.host, info.port), timeout=seconds)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            raise StoreError(f"cannot connect to {where}: {describe(exc)}") from exc
    else:
        where += " on this host"
    sock: socket.socket = raw
    try:
        if aborter is not None:
            aborter.watch(raw)
        raw.sendall(STORE_PREAMBLE)
        sock = ssl_context.wrap_socket(raw, server_hostname=info.host)
        if aborter is not None:
            aborter.watch(sock)
        conn = StoreConnection(sock, where, max_payload, local=raw.family == socket.AF_UNIX)
        conn.send(
            Hello(
                version=PROTOCOL_VERSION,
                role="store",
                token=token,
                software=f"vpool-agent {__version__}",
            )
        )
        welcome = conn._expect(Welcome, seconds)
        assert isinstance(welcome, Welcome)
        if welcome.version != PROTOCOL_VERSION:
            raise StoreError(
                f"{where} speaks protocol {welcome.version}, this agent {PROTOCOL_VERSION}",
                ErrorCode.BAD_VERSION,
            )
        sock.settimeout(IDLE_TIMEOUT)
        if welcome.bulk:
            conn.enable_bulk()  # an abort's shutdown of ``sock`` ends the stream beneath too
        return conn
    except TimeoutError as exc:
        sock.close()
        raise StoreError(f"{where} did not answer within {seconds:g} s") from exc
    except (OSError, ValueError) as exc:
        sock.close()
        raise StoreError(f"cannot connect to {where}: {describe(exc)}") from exc
    except BaseException:
        sock.close()
        raise


def _connect_local(info: RelayInfo, seconds: float) -> socket.socket | None:
    """A connection to the same-host socket of the relay at ``info`` (``protocol.local``),
    or None: not a loopback address, or no such socket (a relay that does not offer one)."""
    if not is_loopback(info.host) or not hasattr(socket, "AF_UNIX"):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(seconds)
        # Room for several chunks in flight: fewer wake-ups of both ends per image.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LOCAL_SNDBUF)
        sock.connect(local_socket_name(info.port))
    except OSError as exc:
        sock.close()
        logger.debug("no same-host socket for %s:%d (%s): TCP", info.host, info.port, describe(exc))
        return None
    return sock
