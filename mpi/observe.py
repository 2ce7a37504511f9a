"""Observations of a second thread, logged as determinants; checkpoints that must wait for it.

A rank's determinants (``protocol/rank_ft.py``) make its MPI calls come out the same on replay
as long as everything they depend on is program order or a logged outcome. A program thread
besides the main one breaks that when what it *does* depends on what another thread did by
then: ``mpi4py.futures``' manager thread looks at a task queue the main thread fills, and at
the clock. ``value(live)`` makes such a look a decision event of kind ``K_VALUE``: live, it
records what ``live()`` returned (None, "nothing to see", is a failed test, logged lazily as
failed tests are); on replay it returns the logged value instead, and the caller then waits
with ``until(ready)`` for its own state to be able to give it (the queue holding an item: the
main thread replays its program, so it will put it there). Call ``value`` where the thread's
MPI calls are serialized (``mpi4py.futures``' ``serialized`` lock), so the event's number is
taken between the same MPI calls as live; call ``until`` outside that lock, so the thread it
waits for is not held up.

Checkpoints (``checkpoint.py``) fork the process, and the clone has only the forking thread:
a process restored from it has lost the other one (or, forked from that one, the main thread).
``thread()`` marks the life of such a thread; while any is marked, a checkpoint request is
answered as failed ("the rank could not fork: ...", in the agent's log and the checkpoint's
failure), so the rank's recovery replays from its newest checkpoint taken before, or from the
start.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from vpool.mpi import environment
from vpool.protocol.rank_ft import K_VALUE

# Replay waits: from WAIT_MIN doubling to WAIT_MAX between looks at the condition.
WAIT_MIN = 0.0005
WAIT_MAX = 0.02

_lock = threading.Lock()
_threads: dict[int, str] = {}  # ident -> what runs there (a thread that forbids checkpoints)


def value(live: Callable[[], Any]) -> Any:
    """One observation: ``live()`` now, logged (None is "nothing seen"), or the logged value on
    replay. Without a pool (no agent, a singleton) it is ``live()`` and nothing is logged."""
    eng = environment._engine
    if eng is None or eng.transport is None:
        return live()
    return eng.ft.decide(K_VALUE, live)


def until(ready: Callable[[], bool], *, timeout: float | None = None) -> bool:
    """Wait, polling, until ``ready()`` (a logged observation can be reproduced); False if
    ``timeout`` seconds passed first. Live, ``ready()`` is true at once."""
    if ready():
        return True
    deadline = None if timeout is None else time.monotonic() + timeout
    pause = WAIT_MIN
    while not ready():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, WAIT_MAX)
    return True


def replaying() -> bool:
    """Whether this rank still obeys logged determinants (observations come from the log)."""
    eng = environment._engine
    return eng is not None and eng.transport is not None and eng.ft.busy()


@contextmanager
def thread(what: str) -> Iterator[None]:
    """Mark the current thread as one a checkpoint cannot keep, while the block runs."""
    ident = threading.get_ident()
    with _lock:
        _threads[ident] = what
    try:
        yield
    finally:
        with _lock:
            _threads.pop(ident, None)


def blocking_checkpoints() -> str | None:
    """Why a checkpoint cannot be taken now (a marked thread runs), or None."""
    with _lock:
        if not _threads:
            return None
        what = sorted(set(_threads.values()))
        n = len(_threads)
    return (
        f"{n} other thread(s) run ({', '.join(what)}): a forked clone keeps one "
        "thread, so it could not be restored; recovery replays from an earlier checkpoint "
        "or from the start"
    )
