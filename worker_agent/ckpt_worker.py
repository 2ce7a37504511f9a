"""A checkpoint worker: the agent's process that dumps a rank's clone and uploads its image.

    python -m vpool.worker_agent.ckpt_worker NICE    (started by ``ckpt_workers.CkptWorkers``)

Why a process of its own, and not a thread of the agent's: the agent is on the ranks' message
path (it forwards every frame between its ranks and the relays), and a checkpoint's packing
runs at a lower priority than the ranks (``checkpoint_nice``) so that it takes only the CPU
they leave idle. A niced *thread* shares the agent's GIL. When the scheduler takes the CPU
from it while it holds the GIL (between two C calls of the packing), the agent's loop waits
for the GIL until the niced thread runs again, which on a machine whose ranks keep every core
busy is a long time: a priority inversion. ``benchmarks/gil_inversion.py`` measures it: a
loop that wants the GIL every millisecond stood still for up to 0.5-0.8 s at a time beside
a niced packing thread, and for no longer than without it beside a niced packing process.

One task at a time, as frames on stdin and stdout (4-byte big-endian length, msgpack):

    agent -> worker   Task
    worker -> agent   Dumped(seconds)   CRIU is done with the clone (it killed it)
    worker -> agent   WantAck           the image is sent but for its CkptEnd
    agent -> worker   Acked(error)      the relays acknowledged what the rank sent ("": yes)
    worker -> agent   Done(size) | Failed(kind, message, code)

A failed task leaves the worker ready for the next one. The worker exits at the end of its
stdin, which is when the agent closes it or ends (``PR_SET_PDEATHSIG`` would not do: it fires
when the *thread* that started the process ends, and trio starts processes from its worker
threads); the agent kills it (its process group: CRIU with it) when a checkpoint is cancelled.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import outcome
import trio

from vpool import tls
from vpool.framestream import FrameStream
from vpool.niceness import lower_this_process
from vpool.protocol.api import RelayInfo
from vpool.protocol.errors import RemoteProtocolError
from vpool.protocol.framing import PREFIX_SIZE, encode_struct
from vpool.protocol.messages import CkptPut
from vpool.worker_agent import ckpt_image, criu
from vpool.worker_agent.store_client import Aborter, StoreError, open_store, run_in_thread

MAX_FRAME = 1 << 20  # a Task holds tokens, counters and the manifest: kilobytes


class Task(msgspec.Struct, tag="task"):
    """Dump process ``clone`` (a pid of the PID namespace of host pid ``enter``, if given) into
    ``scratch``/images and store the image at ``relay`` as ``put``."""

    ckpt: int
    clone: int
    enter: int | None
    scratch: str
    rank_dir: str
    stream_pages: bool
    criu: str
    dump_timeout: float
    key: bytes
    job: int
    rank: int
    level: int
    put: CkptPut
    relay: RelayInfo | None  # the rank's home relay
    tls: bool  # the agent has a TLS context for the stores (from ``ca``)
    ca: str | None
    agent_token: str
    max_payload: int
    store_timeout: float
    local: bool = True  # a store at a loopback address through its same-host socket


class Acked(msgspec.Struct, tag="acked"):
    error: str = ""


class Dumped(msgspec.Struct, tag="dumped"):
    seconds: float


class WantAck(msgspec.Struct, tag="want_ack"):
    pass


class Done(msgspec.Struct, tag="done"):
    size: int


class Failed(msgspec.Struct, tag="failed"):
    kind: str  # "criu", "store" or "other"
    message: str
    code: str = ""


ToWorker = Task | Acked
FromWorker = Dumped | WantAck | Done | Failed


class WorkerProtocolError(Exception):
    """A frame that is not the one expected, or too long, or cut short."""


class AckRefused(Exception):
    """The agent said the relays did not acknowledge the rank's messages."""


frame = encode_struct


class LinkReader:
    """Messages of one union (``ToWorker`` or ``FromWorker``) from a trio stream: payload-less
    frames of the wire format, read by ``protocol.framing.FrameScanner``."""

    def __init__(self, stream: trio.abc.ReceiveStream, kind: object) -> None:
        self.frames = FrameStream(stream, max_header=MAX_FRAME, max_payload=0)
        self.decoder: msgspec.msgpack.Decoder = msgspec.msgpack.Decoder(kind)

    async def next(self) -> object | None:
        """The next message; None at a clean end of stream."""
        try:
            raw = await self.frames.receive_raw()
        except RemoteProtocolError as exc:
            raise WorkerProtocolError(exc.message) from exc
        if raw is None:
            return None
        header_len, data = raw
        try:
            return self.decoder.decode(memoryview(data)[PREFIX_SIZE : PREFIX_SIZE + header_len])
        except msgspec.DecodeError as exc:
            raise WorkerProtocolError(f"bad frame: {exc}") from exc


# -- the worker's side ------------------------------------------------------------------------


class _Session:
    def __init__(self, reader: LinkReader, out: trio.abc.SendStream) -> None:
        self.reader = reader
        self.out = out

    async def send(self, msg: msgspec.Struct) -> None:
        await self.out.send_all(frame(msg))

    async def acked(self) -> None:
        await self.send(WantAck())
        msg = await self.reader.next()
        if not isinstance(msg, Acked):
            raise WorkerProtocolError(f"expected Acked, got {type(msg).__name__}")
        if msg.error:
            raise AckRefused(msg.error)


async def run_task(task: Task, session: _Session) -> int:
    """Dump and store ``task``'s image; its size."""
    scratch = Path(task.scratch)
    images = scratch / "images"
    # The whole worker runs at the agent's checkpoint niceness: CRIU inherits it.
    dump = functools.partial(
        criu.dump,
        task.clone,
        images,
        criu=task.criu,
        log_dir=scratch,
        timeout=task.dump_timeout,
        enter=task.enter,
    )
    if task.stream_pages:
        return await _dump_streaming(task, images, dump, session)
    seconds = await dump()
    await session.send(Dumped(seconds))
    meta = msgspec.msgpack.decode(task.put.meta) if task.put.meta else {}
    meta["dump_s"] = round(seconds, 3)
    task.put = msgspec.structs.replace(task.put, meta=msgspec.msgpack.encode(meta))
    return await _store(task, images, None, session)


async def _dump_streaming(
    task: Task, images: Path, dump: Callable[[], Awaitable[float]], session: _Session
) -> int:
    """Dump and store at once: CRIU writes the clone's pages into a pipe (``criu.PagesPipe``)
    that the upload reads, then the rest of the images follow."""
    pipe = criu.PagesPipe(images)

    async def run_dump() -> None:
        error: BaseException | None = None
        try:
            seconds = await dump()
            await session.send(Dumped(seconds))
        except BaseException as exc:
            error = exc  # the upload raises it (``PagesPipe.wait_dump``)
            if not isinstance(exc, Exception):
                pipe.abandoned = True
                raise
        finally:
            pipe.ended(error)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_dump)
            stored = await outcome.acapture(_store, task, images, pipe, session)
            if isinstance(stored, outcome.Error):
                nursery.cancel_scope.cancel()  # CRIU may wait for room in the pipe
    finally:
        pipe.close()
    return stored.unwrap()  # raises the dump's error too (``PagesPipe.wait_dump``)


async def _store(task: Task, images: Path, pipe: criu.PagesPipe | None, session: _Session) -> int:
    # Each piece is sent before the next is made: one frame buffer serves them all.
    writer = ckpt_image.ImageWriter(
        task.key, job=task.job, rank=task.rank, ckpt=task.ckpt, level=task.level, reuse=True
    )
    rank_dir = Path(task.rank_dir)
    token = trio.lowlevel.current_trio_token()

    def upload(aborter: Aborter) -> None:
        if pipe is not None:
            # Nothing is sent before CRIU writes pages: a dump that fails before that fails
            # alone, and no store sees a put for it.
            pipe.wait_pages()
        if task.relay is None:
            raise StoreError("the lease names no home relay for the rank's images")
        if not task.tls:
            raise StoreError("no TLS context for the relays' checkpoint stores")
        ssl_context = tls.client_context(Path(task.ca) if task.ca else None)
        with open_store(
            task.relay,
            ssl_context=ssl_context,
            token=task.agent_token,
            max_payload=task.max_payload,
            aborter=aborter,
            local=task.local,
        ) as conn:
            conn.put_begin(task.put)
            if pipe is None:
                pieces = writer.pack(images, rank_dir)
            else:
                stream = ckpt_image.Stream(criu.PAGES_NAME, pipe.read_into)
                pieces = writer.pack(images, rank_dir, streams=[stream], then=pipe.wait_dump)
            for piece in pieces:
                conn.put_chunk(task.ckpt, piece)
            trio.from_thread.run(session.acked, trio_token=token)
            conn.put_end(task.ckpt, writer.size, writer.digest, timeout=task.store_timeout)

    await run_in_thread(upload)
    return int(writer.size)


def failure(exc: BaseException) -> Failed:
    """How ``exc`` is told to the agent."""
    if isinstance(exc, BaseExceptionGroup):
        parts = [failure(e) for e in exc.exceptions]
        first = parts[0]
        return Failed(first.kind, "; ".join(p.message for p in parts), first.code)
    message = str(exc) or type(exc).__name__
    if isinstance(exc, criu.CriuError):
        return Failed("criu", message)
    if isinstance(exc, StoreError):
        return Failed("store", message, exc.code)
    return Failed("other", message)


async def serve(stdin: trio.abc.ReceiveStream, stdout: trio.abc.SendStream) -> None:
    """Run tasks until the end of ``stdin``."""
    reader = LinkReader(stdin, ToWorker)
    session = _Session(reader, stdout)
    while True:
        msg = await reader.next()
        if msg is None:
            return
        if not isinstance(msg, Task):
            raise WorkerProtocolError(f"expected a Task, got {type(msg).__name__}")
        try:
            size = await run_task(msg, session)
        except WorkerProtocolError:
            raise
        except Exception as exc:  # told to the agent; the worker serves the next task
            await session.send(failure(exc))
        else:
            await session.send(Done(size))


async def _main() -> None:
    stdin = trio.lowlevel.FdStream(sys.stdin.fileno())
    stdout = trio.lowlevel.FdStream(sys.stdout.fileno())
    await serve(stdin, stdout)


def main() -> None:
    # Started at the agent's priority, so that its imports (0.4 s of CPU) take a second even
    # on a machine the ranks keep busy, not the minute they would take at niceness 19; then
    # it lowers itself for good (CRIU inherits that) before its first task.
    nice = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if nice > 0:
        lower_this_process(nice)
    logging.basicConfig(level=logging.WARNING, format="ckpt_worker: %(message)s")
    try:
        trio.run(_main)
    except WorkerProtocolError as exc:
        print(f"ckpt_worker: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
