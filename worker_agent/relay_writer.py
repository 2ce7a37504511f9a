"""The sending half of one agent -> relay connection: a bounded queue of frames and the task
that drains it, gathering small frames into single writes.

Write-through: a sender that finds the queue empty and no write in progress writes its frame
itself instead of handing it to the writer task (a task switch per message is a large part of a
small message's cost). Such writes are shielded from cancellation: a write abandoned half way
would corrupt the TLS stream every rank of this agent shares. They still end when the
connection closes the stream.

Lazy frames (``put_lazy``): the deposit of a message this agent delivered to its receiver
itself (agent-local delivery) waits up to ``LAZY_DELAY``, or until ``LAZY_BYTES`` gather, and
goes out with whatever is written next. Nobody waits for it (only its ``Ack``, which a sender's
``Finalize`` and checkpoint need, comes that much later), and one write of many deposits costs
the agent and the relay far less than one write each: on a ping-pong between two ranks of one
agent, most of the agent's and relay's time was these writes, and the relay's work (and its
acks) competes with the ranks for the CPU. Measured there (2 cores): an 8 B round trip took
about 600 us with every deposit written at once, 275 us with 2 ms of delay, 190 us with 20 ms,
185 us with 50 ms. A frame put the usual way takes the lazy ones along, ahead of it, so a
channel never overtakes itself.

A writer lives as long as its connection: once ``close``d (the connection dropped) every sender
waiting on it gets ``Dropped``, and a reconnected link starts a new writer.
"""

from __future__ import annotations

import math
from collections import deque

import trio

from vpool.framestream import send_frames
from vpool.protocol.framing import Buffer
from vpool.reasons import describe
from vpool.worker_agent.errors import RelayLinkError

# Frames queued for one relay before senders wait: back-pressure from a slow relay.
QUEUE = 512
_BATCH = 256 * 1024
LAZY_DELAY = 0.02  # seconds
LAZY_BYTES = 256 * 1024


class Dropped(RelayLinkError):
    """The connection under a send dropped; its link may be reconnecting."""


class FrameWriter:
    def __init__(self, stream: trio.abc.SendStream, where: str) -> None:
        self._stream = stream
        self.where = where
        # Frames waiting for the writer task, oldest first; ``_busy`` while some task writes.
        self._out: deque[list[Buffer]] = deque()
        # Lazy frames (``put_lazy``), their bytes, and when they are due at the latest.
        self._lazy: list[list[Buffer]] = []
        self._lazy_bytes = 0
        self._lazy_due = math.inf
        self._busy = False
        self._wake = trio.Event()
        self._space = trio.Event()
        self.closed = False
        # Why a write-through failed; ``scope`` (the connection's) is cancelled then.
        self.error = ""
        self.scope: trio.CancelScope | None = None

    def close(self) -> None:
        """The connection is gone: drop what is queued and wake every waiting sender."""
        self.closed = True
        self._out.clear()
        self._lazy.clear()
        self._wake.set()
        self._space.set()

    async def run(self) -> None:
        """Drain the queue until closed (raises what a failed write raises)."""
        out = self._out
        while True:
            while True:
                if self.closed:
                    return
                if self._lazy and trio.current_time() >= self._lazy_due:
                    self._release_lazy()
                if out and not self._busy:
                    break
                self._wake = trio.Event()
                with trio.move_on_at(self._lazy_due if self._lazy else math.inf):
                    await self._wake.wait()
            batch = [out.popleft()]
            size = sum(map(len, batch[0]))
            while out and size < _BATCH:
                item = out.popleft()
                batch.append(item)
                size += sum(map(len, item))
            self._space.set()
            self._busy = True
            try:
                await send_frames(self._stream, [p for parts in batch for p in parts])
            finally:
                self._busy = False

    async def put(self, parts: list[Buffer]) -> None:
        """Write one frame now if idle, else queue it, waiting while the queue is full."""
        if self.closed:
            raise Dropped(f"connection to {self.where} dropped")
        if not self._busy and not self._out:
            if self._lazy:
                parts = [*(p for frame in self._lazy for p in frame), *parts]
                self._lazy.clear()
                self._lazy_bytes = 0
                self._lazy_due = math.inf
            await self._write_through(parts)
            return
        self._release_lazy()
        await self._wait_room()
        # Not yielding while there is room lets a sender hand over every frame it has
        # buffered before the writer runs, which then sends them all in one write.
        self._out.append(parts)
        self._wake.set()

    async def put_lazy(self, parts: list[Buffer]) -> None:
        """Queue a frame that may wait (see the module docstring)."""
        if self.closed:
            raise Dropped(f"connection to {self.where} dropped")
        await self._wait_room()
        if not self._lazy:
            self._lazy_due = trio.current_time() + LAZY_DELAY
            self._wake.set()  # the writer task arms its timer
        self._lazy.append(parts)
        self._lazy_bytes += sum(map(len, parts))
        if self._lazy_bytes >= LAZY_BYTES or len(self._lazy) >= QUEUE // 2:
            self._release_lazy()
            self._wake.set()

    def _release_lazy(self) -> None:
        if self._lazy:
            self._out.extend(self._lazy)
            self._lazy.clear()
            self._lazy_bytes = 0
        self._lazy_due = math.inf

    async def _wait_room(self) -> None:
        while len(self._out) + len(self._lazy) >= QUEUE:
            # Several senders (ranks) may wait: they share one event, renewed only once it
            # fired. A sender that replaced it would strand the others on the old one forever.
            if self._space.is_set():
                self._space = trio.Event()
            await self._space.wait()
            if self.closed:
                raise Dropped(f"connection to {self.where} dropped")

    def put_nowait(self, parts: list[Buffer]) -> None:
        """Queue a small frame without waiting (may overrun the bound; for credits)."""
        if not self.closed:
            self._out.append(parts)
            self._wake.set()

    async def _write_through(self, parts: list[Buffer]) -> None:
        self._busy = True
        try:
            with trio.CancelScope(shield=True):
                await send_frames(self._stream, parts)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            if not self.error:
                self.error = describe(exc)
            if self.scope is not None:
                self.scope.cancel()
            raise Dropped(f"connection to {self.where} dropped") from exc
        finally:
            self._busy = False
            if self._out:
                self._wake.set()
