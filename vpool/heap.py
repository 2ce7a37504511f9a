"""Giving memory a burst freed back to the system.

A coordinator that serves a job's 48 MiB of output a page at a time frees every page once it is
sent, but glibc's allocator keeps the freed memory in its heaps (the worker threads' arenas
above all, which it never trims by itself): eight views of such a job left a coordinator at
twice its size for good, with nothing in Python's own books (``tracemalloc``) to show for it.
``malloc_trim(0)`` hands that memory back. ``keep_trimmed`` calls it, at most once a
``period``, when the process grew by ``growth`` bytes since the last trim (a trim in the middle
of a burst must not stop the one after it: the growth is small); elsewhere than glibc it does
nothing. A trim walks the heaps' free chunks: a few milliseconds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
from collections.abc import Callable
from pathlib import Path

import trio

log = logging.getLogger("vpool.heap")

PERIOD = 10.0  # s between looks at the process's size
GROWTH = 1 << 20  # bytes the process grows by before a trim is worth its heap walk


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has none)
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def trim() -> bool:
    """Give the heap's free memory back to the system; False where that cannot be done."""
    call = _malloc_trim()
    if call is None:
        return False
    call(0)
    return True


def resident() -> int:
    """This process's resident memory, in bytes (0 where /proc does not say)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


async def keep_trimmed(period: float = PERIOD, growth: int = GROWTH) -> None:
    """Run forever: trim whenever the process grew by ``growth`` since the last trim."""
    if _malloc_trim() is None:
        return
    floor = resident()
    while True:
        await trio.sleep(period)
        size = resident()
        if size - floor < growth:
            floor = min(floor, size)
            continue
        # Cyclic garbage first: a cancelled response's frames hold its last page of output
        # until the collector's rare full pass.
        gc.collect()
        trim()
        floor = resident()
        log.debug("heap trimmed: %d MiB -> %d MiB resident", size >> 20, floor >> 20)
