"""A rank's stdout and stderr, read from its pipes and posted to the coordinator in batches.

Output is gathered for up to ``interval`` seconds or ``batch_bytes`` bytes, then posted as
``OutputChunk``s carrying each stream's byte offset, so a re-sent chunk after a failed post is
stored once. When the coordinator is slow the buffer stops growing at ``max_buffered`` and the
rank blocks on its own writes, like a program piped into a slow reader.

A restored rank's streams go on from the offsets its checkpoint noted (``start``), so the
coordinator, which keeps only bytes beyond the highest offset it has, shows nothing twice.
``stream_offsets`` gives, for a checkpoint, where each stream stands: the bytes read from its
pipe plus those still in it (``FIONREAD``).
"""

from __future__ import annotations

import array
import fcntl
import termios
from collections.abc import Awaitable, Callable, Mapping

import trio

from vpool.protocol.api import Lease, OutputBatch, OutputChunk, Stream

Post = Callable[[OutputBatch], Awaitable[None]]

STREAMS: tuple[Stream, Stream] = ("stdout", "stderr")


class OutputPump:
    def __init__(
        self,
        lease: Lease,
        post: Post,
        *,
        interval: float = 0.1,
        batch_bytes: int = 64 * 1024,
        max_buffered: int = 4 * 1024 * 1024,
        max_post: int = 1024 * 1024,
        start: Mapping[str, int] | None = None,
    ) -> None:
        self.lease = lease
        self._post = post
        self.interval = interval
        self.batch_bytes = batch_bytes
        self.max_buffered = max_buffered
        self.max_post = max_post
        self._bufs: dict[Stream, bytearray] = {s: bytearray() for s in STREAMS}
        start = start or {}
        # Stream offset of the bytes already posted, and of the bytes already read.
        self.offsets: dict[Stream, int] = {s: int(start.get(s, 0)) for s in STREAMS}
        self.read: dict[Stream, int] = dict(self.offsets)
        self._fds: dict[Stream, int] = {}
        self._readers = 0
        # A checkpoint holds the pump (``hold``/``release``): readers park, nothing is read.
        self._held: trio.Event | None = None
        self._parked = 0
        self._park_changed = trio.Event()
        self._receiving: dict[Stream, trio.CancelScope] = {}
        self._some = trio.Event()  # there is something to post
        self._enough = trio.Event()  # post now: a full batch, or a stream ended
        self._room = trio.Event()  # a post made room in the buffers
        self.done = trio.Event()  # both pipes ended and everything was posted

    async def run(
        self, stdout: trio.abc.ReceiveStream | None, stderr: trio.abc.ReceiveStream | None
    ) -> None:
        """Pump both pipes until they close and everything read has been posted."""
        async with trio.open_nursery() as nursery:
            for name, pipe in zip(STREAMS, (stdout, stderr), strict=True):
                if pipe is not None:
                    self._readers += 1
                    fileno = getattr(pipe, "fileno", None)
                    if fileno is not None:
                        self._fds[name] = fileno()
                    nursery.start_soon(self._read, name, pipe)
            nursery.start_soon(self._flush_loop)
        self.done.set()

    async def _read(self, name: Stream, pipe: trio.abc.ReceiveStream) -> None:
        buf = self._bufs[name]
        try:
            while True:
                while len(buf) >= self.max_buffered:
                    await self._room.wait()
                held = self._held
                if held is not None:
                    self._parked += 1
                    self._park_changed.set()
                    try:
                        await held.wait()
                    finally:
                        self._parked -= 1
                    continue
                with trio.CancelScope() as scope:
                    self._receiving[name] = scope
                    try:
                        data = await pipe.receive_some(64 * 1024)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        data = b""
                del self._receiving[name]
                if scope.cancelled_caught:
                    continue  # held meanwhile (a cancelled receive read nothing)
                if not data:
                    return
                # No await between the read and this count: ``stream_offsets`` relies on it.
                self.read[name] += len(data)
                buf += data
                self._some.set()
                if len(buf) >= self.batch_bytes:
                    self._enough.set()
        finally:
            self._readers -= 1
            self._park_changed.set()
            self._some.set()
            self._enough.set()

    async def hold(self) -> None:
        """Stop reading the rank's pipes; returns once no reader can take another byte, so
        ``read`` stays what it is until ``release`` (a checkpoint's output offsets are then
        ``read`` plus what the rank finds still in its pipes when it forks)."""
        if self._held is None:
            self._held = trio.Event()
        for scope in list(self._receiving.values()):
            scope.cancel()
        while self._parked < self._readers:
            self._park_changed = trio.Event()
            await self._park_changed.wait()

    def release(self) -> None:
        """Read on (no-op when not held)."""
        held, self._held = self._held, None
        if held is not None:
            held.set()

    def stream_offsets(self) -> dict[Stream, int]:
        """Where each stream stands now: bytes read plus bytes waiting in its pipe. Exact while
        the rank writes nothing (it waits in a checkpoint handshake, its stdio flushed)."""
        return {name: self.read[name] + _pending(self._fds.get(name)) for name in STREAMS}

    async def _flush_loop(self) -> None:
        while True:
            await self._some.wait()
            with trio.move_on_after(self.interval):
                await self._enough.wait()
            self._some = trio.Event()
            self._enough = trio.Event()
            while any(self._bufs.values()):
                await self._flush_once()
            if self._readers == 0:
                return

    async def _flush_once(self) -> None:
        lease = self.lease
        chunks = []
        for name in STREAMS:
            buf = self._bufs[name]
            if buf:
                chunks.append(
                    OutputChunk(
                        job=lease.job,
                        rank=lease.rank,
                        incarnation=lease.incarnation,
                        stream=name,
                        offset=self.offsets[name],
                        data=bytes(buf[: self.max_post]),
                    )
                )
        await self._post(OutputBatch(chunks=chunks))
        for chunk in chunks:
            del self._bufs[chunk.stream][: len(chunk.data)]
            self.offsets[chunk.stream] += len(chunk.data)
        room, self._room = self._room, trio.Event()
        room.set()


def _pending(fd: int | None) -> int:
    """Bytes waiting to be read in pipe ``fd`` (0 for none or a closed one)."""
    if fd is None or fd < 0:
        return 0
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf, True)
    except OSError:
        return 0
    return buf[0]
