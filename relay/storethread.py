"""One checkpoint store connection, served by a thread of the store process on a blocking socket.

An image is hundreds of megabytes. Received through trio's ``SSLStream`` it costs one trio
await per 16 KiB TLS record: 0.35 s of CPU per 200 MB on the 2-core test machine, against
0.10 s for ``ssl.SSLSocket.recv_into`` looping in a thread. So a store connection, recognised
by its preamble (``ckptstore.STORE_PREAMBLE``, read by ``server``), is handed as a plain socket
to the relay's store process (``storesupervisor``, ``storeworker``), where ``StoreThread.run``
does the TLS handshake (server side), reads the ``Hello`` and serves puts and gets one after
the other, in a thread of its own.

Frames are read with ``recv_into`` into buffers allocated once per connection (a bulk put's
payloads from ``raw``, beneath TLS: ``ckptstore``, "Bulk payloads"); a chunk's payload is read
straight into the buffer of the image file (``DirectFile.receive``, ``O_DIRECT``), MACed
(Poly1305) and digested (``protocol.ckptdigest``) and written from there, and a get is read
with ``os.preadv`` into the buffer of the frame it is sent in. Everything that touches the
relay's state (the signing key, the refusals of a put, the ``uploading`` set, the commit and
its report, the image index) is asked of the relay through the link with ``RelayLink``'s
methods (``storeworker``): each sends a typed request (``storelink``) answered with a typed
answer from ``CheckpointStore`` in the relay's loop.

The messages, their order and the error codes are in ``ckptstore``'s docstring. The socket
has a timeout (``handshake_timeout`` up to the ``Hello``, then ``store_idle_timeout``); the
relay shuts the socket down (its copy of it) when it stops, which ends every blocking call
here.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import ssl
import time
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from cryptography.hazmat.primitives.poly1305 import Poly1305

from vpool.protocol.ckptdigest import MAC_KEY, ImageDigest
from vpool.protocol.errors import ErrorCode, RemoteProtocolError, TokenError, ends_connection
from vpool.protocol.framing import (
    DEFAULT_MAX_HEADER,
    PREFIX,
    PREFIX_SIZE,
    FrameScanner,
    Large,
    Small,
    decode_head,
    encode_frame,
)
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
    encode,
)
from vpool.protocol.relay_core import Refused, may_read_image
from vpool.protocol.tokens import AgentClaims, RankClaims, verify_token
from vpool.relay.ckptstore import (
    PART,
    READ_CHUNK,
    STORE_MAX_CHUNK,
    Image,
    ckpt_dir,
    delete_image,
    write_manifest,
)
from vpool.relay.directwrite import DirectFile
from vpool.relay.hub import now

if TYPE_CHECKING:
    from vpool.relay.storeworker import RelayLink

logger = logging.getLogger(__name__)

# A Hello is a version, a role and a token of a few hundred bytes.
HELLO_MAX_HEADER = 8 * 1024
# How long a rejected agent gets to read its Error before the connection is closed.
ERROR_LINGER = 2.0
EMPTY = memoryview(b"")
# At most this many bytes of a bulk payload are waited for at once: a sender must get this
# far within ``store_idle_timeout`` (4 KiB/s for the default 60 s).
BULK_LOWAT = 256 << 10


class Upload:
    """An image being received into its part file."""

    def __init__(
        self, put: CkptPut, claims: RankClaims, directory: Path, file: DirectFile, tmp: Path
    ) -> None:
        self.put = put
        self.claims = claims
        self.key = (claims.job, claims.rank)
        self.directory = directory
        self.file = file
        self.tmp = tmp
        self.size = 0
        self.hasher = ImageDigest()
        # The transport MAC (``protocol.ckptdigest``); none on a same-host link, where nothing
        # can change the bytes on their way (``protocol.local``).
        self.mac = Poly1305(put.mac_key) if put.mac_key else None

    def discard(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


class StoreThread:
    """One store connection (module docstring). ``sock`` is the accepted TCP socket after the
    preamble; ``raw`` a duplicate of it, for bulk payloads and for lingering."""

    def __init__(
        self,
        link: RelayLink,
        cid: int,
        sock: socket.socket,
        raw: socket.socket,
        ssl_context: ssl.SSLContext | None,
        peer: str,
    ) -> None:
        self.link = link
        self.cid = cid
        self.settings = link.init
        self.sock: socket.socket = sock
        self.raw = raw
        self.ssl_context = ssl_context
        self.peer = peer
        self.local = raw.family == socket.AF_UNIX  # a same-host link (``protocol.local``)
        self.agent = ""
        self.key: Ed25519PublicKey | None = None
        # Set while an image is received (the relay releases its ``uploading`` entry if the
        # session ends with one).
        self.upload: Upload | None = None
        self.discard = -1  # ckpt id of a refused put whose chunks are dropped
        self.bulk = -1  # ckpt id of the put whose payloads come beneath TLS (``CkptPut.bulk``)
        # Exact reads (``needed``): every frame with a payload comes out as its head first.
        self._scanner = FrameScanner(max_header=HELLO_MAX_HEADER, max_payload=0, large=0)
        self._payload: memoryview | None = None  # STORE_MAX_CHUNK, once the agent is known
        self.reason = "the agent closed the store connection"

    def __repr__(self) -> str:
        return f"<StoreThread agent={self.agent or '?'} peer={self.peer}>"

    # -- the connection -----------------------------------------------------------------------

    def run(self) -> None:
        """Serve the connection until it ends (a thread of the store process)."""
        try:
            self._serve()
        except Refused as rej:
            logger.info("%r: %s", self, rej.message)
            self.reason = f"rejected ({rej.code}): {rej.message}"
            self._fail(Error(code=rej.code, message=rej.message))
        except TimeoutError:
            self.reason = "timed out"
            logger.info("%r: nothing read for %.0f s", self, self.sock.gettimeout() or 0)
            idle = "the store connection was idle" if self.agent else "no Hello in time"
            self._fail(Error(code=ErrorCode.TIMEOUT, message=idle))
        except (OSError, EOFError) as exc:
            self.reason = f"the store connection broke: {exc}"
        finally:
            up = self.upload
            if up is not None:
                up.discard()
            self.close()
        logger.debug("%r ended: %s", self, self.reason)

    def close(self) -> None:
        self.sock.close()

    def _serve(self) -> None:
        self.sock.settimeout(self.settings.handshake_timeout)
        if self.ssl_context is not None:
            try:
                self.sock = self.ssl_context.wrap_socket(self.sock, server_side=True)
            except (ssl.SSLError, TimeoutError) as exc:
                self.reason = f"no TLS handshake: {exc}"
                return
        self._hello()
        self.sock.settimeout(self.settings.store_idle_timeout)
        self.raw.settimeout(self.settings.store_idle_timeout)  # bulk payloads are read with it
        self._payload = memoryview(bytearray(STORE_MAX_CHUNK))
        name = self.settings.name
        bulk = self.settings.bulk
        self._send(
            Welcome(version=PROTOCOL_VERSION, relay=name, max_payload=STORE_MAX_CHUNK, bulk=bulk)
        )
        while True:
            try:
                # A chunk's payload goes to its file as it is read: a write error is the
                # image's, met in the middle of its frame.
                frame = self._read_frame(DEFAULT_MAX_HEADER, STORE_MAX_CHUNK)
                if frame is None:
                    return
                self._frame(*frame)
            except Refused as rej:
                if ends_connection(rej.code, rej.rank):
                    raise
                logger.info("%r: %s", self, rej.message)
                self._send(Error(code=rej.code, message=rej.message, job=rej.job, rank=rej.rank))

    def _hello(self) -> None:
        frame = self._read_frame(HELLO_MAX_HEADER, 0)
        if frame is None:
            raise EOFError("closed before its Hello")
        msg = frame[0]
        if type(msg) is not Hello:
            raise Refused(ErrorCode.UNEXPECTED_MESSAGE, f"{type(msg).__name__} before Hello")
        if msg.version != PROTOCOL_VERSION:
            raise Refused(
                ErrorCode.BAD_VERSION,
                f"protocol version {msg.version}; this relay speaks {PROTOCOL_VERSION}",
            )
        if msg.role != "store":
            raise Refused(ErrorCode.BAD_ROLE, f"role {msg.role!r} on a store connection")
        self.key = self.link.signing_key(self.cid)
        if self.key is None:
            raise Refused(
                ErrorCode.NOT_READY, "the relay is not registered with the coordinator yet"
            )
        try:
            claims = verify_token(msg.token, self.key, now=now(), kind=AgentClaims)
        except TokenError as exc:
            raise Refused(exc.code, exc.message) from exc
        self.agent = claims.agent

    def _fail(self, err: Error) -> None:
        """Send a connection-level ``Error``, end our side and read on below TLS until the
        agent hangs up (closing while its bytes arrive would send a reset, which can throw the
        Error away before the agent read it)."""
        try:
            self._send(err)
            self.raw.settimeout(ERROR_LINGER)
            self.raw.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + ERROR_LINGER
            while time.monotonic() < deadline and self.raw.recv(65536):
                pass
        except OSError:
            pass

    # -- frames -------------------------------------------------------------------------------

    def _send(self, msg: Message) -> None:
        self.sock.sendall(encode_frame(msg))

    def _fill(self, view: memoryview, *, first: bool = False, bulk: bool = False) -> bool:
        """Read exactly ``len(view)`` bytes (``bulk``: from beneath TLS); False at a clean end
        of stream before the first byte of a frame (``first``)."""
        if bulk:
            self._fill_bulk(view)
            return True
        got, n = 0, len(view)
        recv_into = self.sock.recv_into
        while got < n:
            k = recv_into(view[got:])
            if not k:
                if first and got == 0:
                    return False
                raise Refused(ErrorCode.BAD_FRAME, "connection closed in the middle of a frame")
            got += k
        return True

    def _fill_bulk(self, view: memoryview) -> None:
        """``len(view)`` bytes of a payload from beneath TLS, each read waiting until the rest
        (at most ``BULK_LOWAT``) has arrived: ``SO_RCVLOWAT`` keeps the kernel from waking
        this thread for every segment (a loopback microbenchmark of 200 MB: 0.035 -> 0.018 s
        of CPU receiving, 0.064 -> 0.035 s sending). Back to 1 afterwards, or the TLS records
        that follow would wait for bytes that never come."""
        got, n = 0, len(view)
        raw = self.raw
        try:
            while got < n:
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, min(n - got, BULK_LOWAT))
                k = raw.recv_into(view[got:])
                if not k:
                    raise Refused(ErrorCode.BAD_FRAME, "connection closed in the middle of a frame")
                got += k
        finally:
            try:
                raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            except OSError:
                pass  # closed meanwhile: the error that ended the read is the one to see

    def _read_frame(self, max_header: int, max_payload: int) -> tuple[Message, memoryview] | None:
        """The next message; a payload (CkptChunk only) is read here, never past its frame:
        in bulk mode it comes from beneath TLS."""
        scanner = self._scanner
        scanner.set_limits(max_header=max_header, max_payload=max_payload)
        try:
            while (event := scanner.next_event()) is None:
                view = scanner.get_buffer()[: scanner.needed()]
                if not self._fill(view, first=scanner.pending == 0):
                    return None
                scanner.buffer_updated(len(view))
            if type(event) is Small:
                return decode_head(event.frame, event.header_len, 0), EMPTY
            assert type(event) is Large
            msg = decode_head(event.head, event.header_len, event.payload_len)
        except RemoteProtocolError as exc:
            raise Refused(exc.code, exc.message) from exc
        scanner.take_payload()  # empty: no more than the head was read
        payload_len = event.payload_len
        if type(msg) is not CkptChunk:
            raise Refused(ErrorCode.BAD_FRAME, f"{type(msg).__name__} must not carry a payload")
        assert isinstance(msg, CkptChunk)
        bulk = msg.ckpt == self.bulk
        up = self.upload
        if up is not None and msg.ckpt == up.put.ckpt:
            self._receive_chunk(up, payload_len, bulk)
            return msg, EMPTY  # the payload is in the image file's buffer already
        assert self._payload is not None  # max_payload is 0 before the Hello
        payload = self._payload[:payload_len]
        self._fill(payload, bulk=bulk)
        return msg, payload

    def _frame(self, msg: Message, payload: memoryview) -> None:
        up = self.upload
        kind = type(msg)
        if kind is CkptChunk:
            assert isinstance(msg, CkptChunk)
            if up is not None and msg.ckpt == up.put.ckpt:
                pass  # received by _read_frame
            elif msg.ckpt != self.discard:
                raise Refused(
                    ErrorCode.UNEXPECTED_MESSAGE, f"CkptChunk of image {msg.ckpt} out of order"
                )
        elif kind is CkptEnd:
            assert isinstance(msg, CkptEnd)
            if msg.ckpt == self.bulk:
                self.bulk = -1
            if up is not None and msg.ckpt == up.put.ckpt:
                self._finish(up, msg)
            elif msg.ckpt == self.discard:
                self.discard = -1
            else:
                raise Refused(
                    ErrorCode.UNEXPECTED_MESSAGE, f"CkptEnd of image {msg.ckpt} out of order"
                )
        elif up is not None or self.discard >= 0:
            raise Refused(
                ErrorCode.UNEXPECTED_MESSAGE, f"{kind.__name__} in the middle of an image upload"
            )
        elif kind is CkptPut:
            assert isinstance(msg, CkptPut)
            # Refused or not, its chunks come the way it says.
            self.bulk = msg.ckpt if msg.bulk else -1
            self._start(msg)
        elif kind is CkptGet:
            assert isinstance(msg, CkptGet)
            self._get(msg)
        else:
            raise Refused(
                ErrorCode.UNEXPECTED_MESSAGE,
                f"{kind.__name__} is not allowed on a store connection",
            )

    def _claims(self, token: str) -> RankClaims:
        assert self.key is not None
        try:
            claims = verify_token(token, self.key, now=now(), kind=RankClaims)
        except TokenError as exc:
            raise Refused(exc.code, f"rank token refused: {exc.message}") from exc
        if claims.agent != self.agent:
            raise Refused(
                ErrorCode.WRONG_TOKEN,
                f"the token of job {claims.job} rank {claims.rank} was issued to agent "
                f"{claims.agent!r}, not to {self.agent!r}",
            )
        return claims

    # -- puts ---------------------------------------------------------------------------------

    def _start(self, put: CkptPut) -> None:
        # A put needs a transport MAC key, except on a same-host link (``protocol.local``),
        # where it may come without one. A bad one closes the connection (``rank=-1``).
        if len(put.mac_key) != MAC_KEY and not (self.local and not put.mac_key):
            raise Refused(
                ErrorCode.BAD_FRAME,
                f"CkptPut of image {put.ckpt} without a {MAC_KEY}-byte mac_key",
            )
        claims = self._claims(put.token)
        rej = self.link.begin_put(self.cid, claims, put.ckpt)
        if rej is not None:
            self.discard = put.ckpt
            raise rej
        directory = ckpt_dir(Path(self.settings.data_dir), claims.job, claims.rank)
        tmp = directory / f"{put.ckpt}.{secrets.token_hex(4)}{PART}"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            file = DirectFile(tmp)
        except OSError as exc:
            self.link.end_upload(self.cid, (claims.job, claims.rank))
            self.discard = put.ckpt
            raise self._storage(claims.job, claims.rank, exc) from exc
        self.upload = Upload(put, claims, directory, file, tmp)

    def _receive_chunk(self, up: Upload, n: int, bulk: bool) -> None:
        """A chunk's payload of ``n`` bytes, read straight into the image file's buffer
        (``DirectFile.receive``), MACed and digested there."""
        up.size += n
        limit = self.settings.checkpoint_max_bytes
        if up.size > limit:
            raise Refused(
                ErrorCode.TOO_LARGE,
                f"image {up.put.ckpt} of rank {up.key[1]} of job {up.key[0]} exceeds the "
                f"relay's limit of {limit} bytes",
            )
        views = up.file.receive(n)
        got = 0
        while True:
            try:
                view = next(views, None)
            except OSError as exc:
                # The rest of the payload is still on the way: read past it.
                assert self._payload is not None
                self._fill(self._payload[: n - got], bulk=bulk)
                self._abort(up)
                self.discard = up.put.ckpt
                raise self._storage(*up.key, exc) from exc
            if view is None:
                return
            self._fill(view, bulk=bulk)
            if up.mac is not None:
                up.mac.update(view)
            up.hasher.update(view)
            got += len(view)

    def _abort(self, up: Upload) -> None:
        """Drop the upload: its part file, and its ``uploading`` entry."""
        self.upload = None
        up.discard()
        self.link.end_upload(self.cid, up.key)

    def _storage(self, job: int, rank: int, exc: OSError) -> Refused:
        logger.warning("checkpoint store of job %d rank %d: %s", job, rank, exc)
        return Refused(
            ErrorCode.STORAGE_ERROR, f"the relay cannot store the image: {exc}", job=job, rank=rank
        )

    def _finish(self, up: Upload, end: CkptEnd) -> None:
        job, rank = up.key
        digest = up.hasher.digest()
        intact = True
        if up.mac is not None:
            try:
                up.mac.verify(end.mac)
            except InvalidSignature:
                intact = False
        if end.size != up.size or end.digest != digest or not intact:
            self._abort(up)
            why = "" if intact else ", and not the bytes the agent sent (transport MAC)"
            raise Refused(
                ErrorCode.CORRUPT,
                f"image {end.ckpt} of rank {rank} of job {job}: {up.size} bytes with digest "
                f"{digest.hex()} arrived{why}, CkptEnd says {end.size} bytes with "
                f"{end.digest.hex()}",
                job=job,
                rank=rank,
            )
        put = up.put
        img = Image(
            job=job,
            rank=rank,
            ckpt=put.ckpt,
            incarnation=up.claims.incarnation,
            size=up.size,
            digest=digest,
            received=dict(put.received),
            dets=put.dets,
            fingerprint=put.fingerprint,
            meta=put.meta,
            directory=up.directory,
        )
        try:
            up.file.finish()
            up.file.close()
            os.rename(up.tmp, img.path)
            write_manifest(img)  # the commit point; fsyncs the directory
        except OSError as exc:
            self._abort(up)
            if self.link.job_finished(self.cid, job):
                raise Refused(
                    ErrorCode.JOB_FINISHED, f"job {job} is over", job=job, rank=rank
                ) from exc
            raise self._storage(job, rank, exc) from exc
        # CkptStored once the coordinator has the image too (``known``): an agent that then
        # reports its rank lost gets a replacement that restores from this image.
        wait = self.settings.store_report_wait
        answer, known = self.link.commit(self.cid, img, wait)
        self.upload = None
        if isinstance(answer, Refused):
            delete_image(img)
            raise answer
        logger.info("job %d rank %d: image %d committed (%d bytes)", job, rank, img.ckpt, img.size)
        if known is False:
            raise Refused(
                ErrorCode.REFUSED,
                f"the coordinator refused image {img.ckpt} of rank {rank} of job {job}",
                job=job,
                rank=rank,
            )
        if known is None:
            logger.info(
                "job %d rank %d: image %d not reported within %g s; stored all the same",
                job,
                rank,
                img.ckpt,
                wait,
            )
        self._send(CkptStored(ckpt=img.ckpt, retained=answer))

    # -- gets ---------------------------------------------------------------------------------

    def _get(self, get: CkptGet) -> None:
        claims = self._claims(get.token)
        job, rank = claims.job, claims.rank
        img = self.link.image(self.cid, (job, rank), get.ckpt)
        fd = -1
        if img is not None:
            try:
                fd = os.open(img.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                fd = -1
        if img is None or fd < 0:
            raise Refused(
                ErrorCode.NOT_FOUND,
                f"no image {get.ckpt} of rank {rank} of job {job} in this store",
                job=job,
                rank=rank,
            )
        try:
            if not may_read_image(claims.incarnation, img.incarnation):
                raise Refused(
                    ErrorCode.FENCED,
                    f"incarnation {claims.incarnation} may not read image {img.ckpt} of "
                    f"incarnation {img.incarnation}",
                    job=job,
                    rank=rank,
                )
            self._send(
                CkptInfo(
                    ckpt=img.ckpt,
                    size=img.size,
                    digest=img.digest,
                    received=img.received,
                    dets=img.dets,
                    fingerprint=img.fingerprint,
                    meta=img.meta,
                )
            )
            self._send_image(img, fd)
            self._send(CkptEnd(ckpt=img.ckpt, size=img.size, digest=img.digest))
        finally:
            os.close(fd)

    def _send_image(self, img: Image, fd: int) -> None:
        """The image as CkptChunk frames, each read from the file into the buffer it is sent
        from (prefix, header, payload: one ``sendall``)."""
        header = encode(CkptChunk(ckpt=img.ckpt))
        start = PREFIX_SIZE + len(header)
        buf = bytearray(start + READ_CHUNK)
        buf[PREFIX_SIZE:start] = header
        view = memoryview(buf)
        offset = 0
        while offset < img.size:
            want = min(READ_CHUNK, img.size - offset)
            try:
                n = os.preadv(fd, [view[start : start + want]], offset)
            except OSError as exc:
                n = 0
                logger.warning("cannot read %s: %s", img.path, exc)
            if not n:
                # Half an image is out: only closing the connection tells the agent.
                raise Refused(ErrorCode.STORAGE_ERROR, f"cannot read image {img.ckpt} in full")
            PREFIX.pack_into(buf, 0, len(header), n)
            self.sock.sendall(view[: start + n])
            offset += n
