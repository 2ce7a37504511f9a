"""One checkpoint store connection: puts streamed to a part file, gets streamed from an image.

The messages, their order and the error codes are in ``ckptstore``'s docstring. The session
reads and writes its stream itself (no writer task): a put is read as fast as the disk takes
it (each read's chunks are written and hashed in a worker thread before the next read), a get
is sent as fast as the agent reads (one 1 MiB chunk read from the file per ``send_all``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from vpool.protocol.errors import RemoteProtocolError, TokenError
from vpool.protocol.framing import (
    DEFAULT_MAX_HEADER,
    PREFIX_SIZE,
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
    Message,
    Welcome,
    decode,
)
from vpool.protocol.tokens import RankClaims, verify_token
from vpool.relay.ckptstore import (
    PART,
    READ_CHUNK,
    STORE_MAX_CHUNK,
    CheckpointStore,
    Image,
    Key,
    ckpt_dir,
    delete_image,
    write_manifest,
)
from vpool.relay.directwrite import DirectFile
from vpool.relay.errors import Rejected
from vpool.relay.hub import now
from vpool.relay.wire import FrameReader, RawFrame

if TYPE_CHECKING:
    from vpool.relay.connection import Connection

logger = logging.getLogger(__name__)

WRITE_BATCH = 4 << 20  # bytes of chunks handed to the writing thread at once


class Upload:
    """An image being received into its part file."""

    def __init__(
        self, put: CkptPut, claims: RankClaims, directory: Path, file: DirectFile, tmp: Path
    ):
        self.put = put
        self.claims = claims
        self.key = (claims.job, claims.rank)
        self.directory = directory
        self.file = file
        self.tmp = tmp
        self.size = 0
        self.hasher = hashlib.sha256()
        # Chunks received but not written yet: written together, WRITE_BATCH bytes at a time.
        self.pending: list[memoryview] = []
        self.pending_bytes = 0

    def write(self, parts: list[memoryview]) -> None:
        """Append payloads (worker thread)."""
        for view in parts:
            self.file.write(view)
            self.hasher.update(view)

    def close(self, *, unlink: bool) -> None:
        self.file.close()
        if unlink:
            self.tmp.unlink(missing_ok=True)


class StoreSession:
    """One store connection (module docstring). Reads and writes the stream itself: a put is
    read as fast as the disk takes it, a get sent as fast as the agent reads."""

    def __init__(self, store: CheckpointStore, conn: Connection, reader: FrameReader) -> None:
        self.store = store
        self.hub = store.hub
        self.conn = conn
        self.stream = conn.stream
        self.reader = reader
        self.upload: Upload | None = None
        self.discard = -1  # ckpt id of a refused put whose chunks are dropped
        self.discard_key: Key = (-1, -1)

    async def send(self, msg: Message, payload: bytes | memoryview = b"") -> None:
        await self.stream.send_all(encode_frame(msg, payload))

    async def run(self, frames: list[RawFrame]) -> None:
        self.reader.max_header = DEFAULT_MAX_HEADER
        self.reader.max_payload = STORE_MAX_CHUNK
        try:
            await self.send(
                Welcome(version=PROTOCOL_VERSION, relay=self.hub.name, max_payload=STORE_MAX_CHUNK)
            )
            while True:
                try:
                    if frames:
                        await self._handle(frames)
                    frames = await self.reader.read_frames()
                except RemoteProtocolError as exc:
                    raise Rejected(exc.code, exc.message) from exc
                if not frames:
                    self.conn.reason = "the agent closed the store connection"
                    return
        except Rejected as rej:
            logger.info("store connection of %s: %s", self.conn.agent, rej.message)
            self.conn.reason = f"rejected ({rej.code}): {rej.message}"
            with trio.move_on_after(2):
                await self.send(Error(code=rej.code, message=rej.message))
                await self.conn._linger()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.conn.reason = "the store connection broke"

    async def _handle(self, frames: list[RawFrame]) -> None:
        """Handle the frames of one read; an error about one rank is answered and the
        frames after it are handled still (they may be the refused image's chunks)."""
        chunks: list[memoryview] = []
        for header_len, frame in frames:
            try:
                chunks = await self._frame(header_len, frame, chunks)
            except Rejected as rej:
                if rej.rank < 0:
                    raise
                chunks = []
                logger.info("store connection of %s: %s", self.conn.agent, rej.message)
                await self.send(
                    Error(code=rej.code, message=rej.message, job=rej.job, rank=rej.rank)
                )
        if chunks:
            try:
                await self._write(chunks, flush=False)
            except Rejected as rej:
                if rej.rank < 0:
                    raise
                await self.send(
                    Error(code=rej.code, message=rej.message, job=rej.job, rank=rej.rank)
                )

    async def _frame(
        self, header_len: int, frame: bytes | bytearray, chunks: list[memoryview]
    ) -> list[memoryview]:
        """Handle one frame; chunk payloads are gathered in ``chunks`` and written together
        before the next other message. Returns the chunks still to write."""
        msg = decode(frame[PREFIX_SIZE : PREFIX_SIZE + header_len])
        payload = memoryview(frame)[PREFIX_SIZE + header_len :]
        if payload and type(msg) is not CkptChunk:
            raise Rejected("protocol_error", f"{type(msg).__name__} must not carry a payload")
        if type(msg) is CkptChunk:
            if self.upload is not None and msg.ckpt == self.upload.put.ckpt:
                self._count(len(payload))
                chunks.append(payload)
            elif msg.ckpt != self.discard:
                raise Rejected("protocol_error", f"CkptChunk of image {msg.ckpt} out of order")
            return chunks
        if chunks or (self.upload is not None and self.upload.pending):
            await self._write(chunks)
            chunks = []
        if type(msg) is CkptEnd:
            if self.upload is not None and msg.ckpt == self.upload.put.ckpt:
                await self._finish(msg)
            elif msg.ckpt == self.discard:
                self.discard = -1
            else:
                raise Rejected("protocol_error", f"CkptEnd of image {msg.ckpt} out of order")
        elif self.upload is not None or self.discard >= 0:
            raise Rejected(
                "protocol_error", f"{type(msg).__name__} in the middle of an image upload"
            )
        elif type(msg) is CkptPut:
            await self._start(msg)
        elif type(msg) is CkptGet:
            await self._get(msg)
        else:
            raise Rejected(
                "protocol_error", f"{type(msg).__name__} is not allowed on a store connection"
            )
        return chunks

    def _claims(self, token: str) -> RankClaims:
        key = self.hub.signing_key
        assert key is not None
        try:
            claims = verify_token(token, key, now=now(), kind=RankClaims)
        except TokenError as exc:
            raise Rejected(exc.code, f"rank token refused: {exc.message}") from exc
        if claims.agent != self.conn.agent:
            raise Rejected(
                "wrong_token",
                f"the token of job {claims.job} rank {claims.rank} was issued to agent "
                f"{claims.agent!r}, not to {self.conn.agent!r}",
            )
        return claims

    def _refuse_put(self, put: CkptPut, claims: RankClaims) -> Rejected | None:
        job, rank = key = (claims.job, claims.rank)
        if job in self.hub.finished:
            return Rejected("job_finished", f"job {job} is over", job=job, rank=rank)
        imgs = self.store.images.get(key, {})
        top = max([self.hub.fence.get(key, 0), *(i.incarnation for i in imgs.values())])
        if claims.incarnation < top:
            return Rejected(
                "fenced",
                f"image {put.ckpt} of incarnation {claims.incarnation} of rank {rank} of job "
                f"{job}: incarnation {top} replaced it",
                job=job,
                rank=rank,
            )
        if imgs and put.ckpt <= max(imgs):
            return Rejected(
                "stale_ckpt",
                f"image {put.ckpt} of rank {rank} of job {job} is not newer than image {max(imgs)}",
                job=job,
                rank=rank,
            )
        if key in self.store.uploading:
            return Rejected(
                "busy",
                f"an image of rank {rank} of job {job} is being uploaded",
                job=job,
                rank=rank,
            )
        return None

    async def _start(self, put: CkptPut) -> None:
        claims = self._claims(put.token)
        rej = self._refuse_put(put, claims)
        if rej is not None:
            self.discard, self.discard_key = put.ckpt, (claims.job, claims.rank)
            raise rej
        directory = ckpt_dir(self.hub.data_dir, claims.job, claims.rank)
        tmp = directory / f"{put.ckpt}.{secrets.token_hex(4)}{PART}"

        def create() -> DirectFile:
            directory.mkdir(parents=True, exist_ok=True)
            return DirectFile(tmp)

        try:
            file = await self.store._io(create)
        except OSError as exc:
            self.discard, self.discard_key = put.ckpt, (claims.job, claims.rank)
            raise self._storage(claims.job, claims.rank, exc) from exc
        self.upload = Upload(put, claims, directory, file, tmp)
        self.store.uploading.add(self.upload.key)

    def _storage(self, job: int, rank: int, exc: OSError) -> Rejected:
        logger.warning("checkpoint store of job %d rank %d: %s", job, rank, exc)
        return Rejected(
            "storage_error", f"the relay cannot store the image: {exc}", job=job, rank=rank
        )

    def _count(self, n: int) -> None:
        up = self.upload
        assert up is not None
        up.size += n
        limit = self.hub.settings.checkpoint_max_bytes
        if up.size > limit:
            raise Rejected(
                "too_large",
                f"image {up.put.ckpt} of rank {up.key[1]} of job {up.key[0]} exceeds the "
                f"relay's limit of {limit} bytes",
            )

    async def _write(self, chunks: list[memoryview], *, flush: bool = True) -> None:
        """Write ``chunks`` after those pending; unless ``flush``, only once WRITE_BATCH bytes
        are pending (one worker-thread round trip per batch, not per chunk)."""
        up = self.upload
        assert up is not None
        up.pending.extend(chunks)
        up.pending_bytes += sum(len(c) for c in chunks)
        if not flush and up.pending_bytes < WRITE_BATCH:
            return
        batch, up.pending, up.pending_bytes = up.pending, [], 0
        try:
            await self.store._io(lambda: up.write(batch))
        except OSError as exc:
            await self.abort_upload()
            self.discard, self.discard_key = up.put.ckpt, up.key
            raise self._storage(*up.key, exc) from exc

    async def abort_upload(self) -> None:
        up, self.upload = self.upload, None
        if up is not None:
            self.store.uploading.discard(up.key)
            await self.store._io(lambda: up.close(unlink=True))

    async def _finish(self, end: CkptEnd) -> None:
        up = self.upload
        assert up is not None
        job, rank = up.key
        digest = up.hasher.digest()
        if end.size != up.size or end.sha256 != digest:
            await self.abort_upload()
            raise Rejected(
                "corrupt",
                f"image {end.ckpt} of rank {rank} of job {job}: {up.size} bytes with SHA-256 "
                f"{digest.hex()} arrived, CkptEnd says {end.size} bytes with {end.sha256.hex()}",
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
            sha256=digest,
            received=dict(put.received),
            dets=put.dets,
            fingerprint=put.fingerprint,
            meta=put.meta,
            directory=up.directory,
        )

        def durable() -> None:
            up.file.finish()
            up.close(unlink=False)
            os.rename(up.tmp, img.path)
            write_manifest(img)  # the commit point; fsyncs the directory

        try:
            await self.store._io(durable)
        except OSError as exc:
            await self.abort_upload()
            if job in self.hub.finished:
                raise Rejected("job_finished", f"job {job} is over", job=job, rank=rank) from exc
            raise self._storage(job, rank, exc) from exc
        self.upload = None
        self.store.uploading.discard(up.key)
        rej = None
        if job in self.hub.finished:
            rej = Rejected("job_finished", f"job {job} is over", job=job, rank=rank)
        elif self.hub.fence.get(up.key, 0) > img.incarnation:
            rej = Rejected(
                "fenced",
                f"incarnation {img.incarnation} of rank {rank} of job {job} was replaced while "
                "its image was uploaded",
                job=job,
                rank=rank,
            )
        if rej is not None:
            await self.store._io(lambda: delete_image(img))
            raise rej
        await self.store.commit(img)
        logger.info("job %d rank %d: image %d committed (%d bytes)", job, rank, img.ckpt, img.size)
        await self.send(CkptStored(ckpt=img.ckpt, retained=self.store.retained(up.key)))

    async def _get(self, get: CkptGet) -> None:
        claims = self._claims(get.token)
        job, rank = claims.job, claims.rank
        img = self.store.images.get((job, rank), {}).get(get.ckpt)
        fd = -1
        if img is not None:
            try:
                fd = await self.store._io(lambda: os.open(img.path, os.O_RDONLY | os.O_CLOEXEC))
            except OSError:
                fd = -1
        if img is None or fd < 0:
            raise Rejected(
                "not_found",
                f"no image {get.ckpt} of rank {rank} of job {job} in this store",
                job=job,
                rank=rank,
            )
        try:
            if claims.incarnation < img.incarnation:
                raise Rejected(
                    "fenced",
                    f"incarnation {claims.incarnation} may not read image {img.ckpt} of "
                    f"incarnation {img.incarnation}",
                    job=job,
                    rank=rank,
                )
            await self.send(
                CkptInfo(
                    ckpt=img.ckpt,
                    size=img.size,
                    sha256=img.sha256,
                    received=img.received,
                    dets=img.dets,
                    fingerprint=img.fingerprint,
                    meta=img.meta,
                )
            )
            chunk = CkptChunk(ckpt=img.ckpt)
            offset = 0
            while offset < img.size:
                try:
                    data = await self.store._io(os.pread, fd, READ_CHUNK, offset)
                except OSError as exc:
                    data = b""
                    logger.warning("cannot read %s: %s", img.path, exc)
                if not data:
                    # Half an image is out: only closing the connection tells the agent.
                    raise Rejected("storage_error", f"cannot read image {img.ckpt} in full")
                # send_all returns once the stream took the bytes: a slow reader holds the
                # next read back, so at most one chunk is buffered here.
                await self.send(chunk, data)
                offset += len(data)
            await self.send(CkptEnd(ckpt=img.ckpt, size=img.size, sha256=img.sha256))
        finally:
            os.close(fd)
