"""Frames and non-blocking socket I/O of ``vsdk mpiexec``'s in-process router.

Plain non-blocking sockets; trio only waits for readiness. Trying the system call first and
waiting only when it would block saves a trip through the scheduler per frame.
"""

from __future__ import annotations

from typing import Any

import trio

from vpool.protocol.framing import PREFIX, FrameScanner, Large, Payload, Small, decode_head
from vpool.protocol.messages import Message, encode

Event = Small | Large | Payload


def _frame(msg: Message) -> bytes:
    header = encode(msg)
    return PREFIX.pack(len(header), 0) + header


# A peer that went away, seen from either direction.
_GONE = (OSError, trio.BrokenResourceError, trio.ClosedResourceError)


async def _acquire(lock: trio.Lock) -> None:
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()


async def _write(sock: Any, data: Any) -> None:
    view = memoryview(data)
    while view.nbytes:
        try:
            n = sock.send(view)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
            continue
        view = view[n:]


async def _read(sock: Any, view: memoryview) -> int:
    while True:
        try:
            return int(sock.recv_into(view))
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)


class SocketFrames:
    """Frames off one non-blocking socket through a ``FrameScanner``: the system call is
    tried first, the scheduler waited on only when it would block (every 16 reads that found
    data in a row, the other ranks' readers get their turn)."""

    def __init__(self, sock: Any, *, buffer_size: int = 0, large: int = 0) -> None:
        self.sock = sock
        kw = {"large": large} if large else {}
        self.scanner = FrameScanner(buffer_size=buffer_size, **kw)
        self._eager = 0

    async def next_event(self) -> Event | None:
        """The next event; None at a clean end of stream between frames."""
        scanner = self.scanner
        while (event := scanner.next_event()) is None:
            if not await self.receive():
                return None
        return event

    async def receive(self) -> bool:
        """One read into the scanner; False at a clean end of stream."""
        scanner = self.scanner
        buf = scanner.get_buffer()
        try:
            n = self.sock.recv_into(buf)
            self._eager += 1
            if self._eager >= 16:
                self._eager = 0
                await trio.lowlevel.checkpoint()
        except BlockingIOError:
            self._eager = 0
            n = await _read(self.sock, buf)
        if not n:
            scanner.eof()
            return False
        scanner.buffer_updated(n)
        return True

    async def message(self) -> Message | None:
        """The next payload-less message (a hello, a control message); None at the end."""
        event = await self.next_event()
        if event is None:
            return None
        if type(event) is not Small:
            raise trio.BrokenResourceError("a frame too large for a control message")
        return decode_head(event.frame, event.header_len, event.payload_len)
