"""Frames and non-blocking socket I/O of ``vsdk mpiexec``'s in-process router.

Plain non-blocking sockets; trio only waits for readiness. Trying the system call first and
waiting only when it would block saves a trip through the scheduler per frame.
"""

from __future__ import annotations

import struct
from typing import Any

import trio

from vpool.protocol.framing import PREFIX
from vpool.protocol.messages import Message, encode

_unpack_prefix = struct.Struct("!II").unpack_from


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


async def _read_exact(sock: Any, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = await _read(sock, view[got:])
        if not k:
            raise trio.BrokenResourceError("connection closed")
        got += k
    return bytes(buf)
