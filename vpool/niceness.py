"""Background work at a lower CPU priority than the ranks it serves.

A checkpoint's dump, packing and upload, and the store's side of it, are work the ranks never
wait for: the original rank keeps computing while its clone is dumped. On a volunteer's
machine the ranks hold every core, so whatever CPU that work takes at the ranks' priority it
takes from a rank, and through the next halo exchange from every rank of the job. At a higher
niceness it runs in the gaps instead (a rank waiting for a message), and takes a core only when
nothing else wants it. BOINC runs the science itself at niceness 19 for the same reason; here
the ranks are the science and the checkpoint is the chore.

Linux gives each thread its own niceness (``setpriority(PRIO_PROCESS, tid)``), and lowering a
thread's priority is always allowed while raising it back is not (without CAP_SYS_NICE). So
the work runs in a fresh thread that ends with it (``run_niced``), never in a pooled thread
that would stay slow for whatever it runs next.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

import outcome

T = TypeVar("T")

MAX_NICE = 19


def nice_command(command: list[str], nice: int) -> list[str]:
    """``command`` started ``nice`` steps nicer than this process (as is when ``nice`` <= 0)."""
    return command if nice <= 0 else ["nice", "-n", str(min(nice, MAX_NICE)), *command]


def lower_this_thread(nice: int) -> None:
    """Make the calling thread ``nice`` steps nicer (never less nice than it is)."""
    if nice <= 0:
        return
    tid = threading.get_native_id()
    current = os.getpriority(os.PRIO_PROCESS, tid)
    os.setpriority(os.PRIO_PROCESS, tid, min(current + nice, MAX_NICE))


def lower_this_process(nice: int) -> None:
    """Make this process (its threads started from now on, and its children) ``nice`` steps
    nicer; its other threads keep their niceness."""
    if nice > 0:
        os.nice(min(nice, MAX_NICE))


def run_niced(fn: Callable[[], T], nice: int) -> T:
    """``fn()`` in a new thread ``nice`` steps nicer than the caller's, waited for; its result
    or its exception is the caller's. ``nice`` <= 0: ``fn()`` in the calling thread."""
    if nice <= 0:
        return fn()
    result: list[outcome.Outcome[T]] = []

    def body() -> None:
        try:
            lower_this_thread(nice)
        except OSError:
            pass  # the work still gets done, at the caller's priority
        result.append(outcome.capture(fn))

    thread = threading.Thread(target=body, name=getattr(fn, "__name__", "niced"), daemon=True)
    thread.start()
    thread.join()
    return result[0].unwrap()
