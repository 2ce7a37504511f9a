"""Collective schedules: point-to-point in a communicator's collective context, and the driver
that runs a collective algorithm either to the end (blocking calls) or step by step (the
non-blocking ``I*`` calls).

An algorithm is a generator: it sends (eagerly, as every send in this runtime) and yields the
list of receives it needs complete before its next step. ``run`` drives it to the end in the
call; ``Schedule`` is the operation behind a non-blocking collective's request and advances the
generator whenever its completion is checked (``Test``, ``Wait``, ``Waitall``...), so a rank
waiting on something else never blocks the steps it owes its peers beyond what MPI's progress
rule allows: every collective's first sends leave at the call.

Each collective started on a communicator takes the next number of its ``cseq`` counter as the
tag of all its messages. Members start collectives in the same order (MPI's rule), so the
numbers agree, and two collectives in flight at once never match each other's messages.
Receives always name their source: collectives make no timing-dependent matching decision.

Failures (ULFM): a collective on a revoked communicator, or on one with a member known failed,
is refused as it starts (``new_tag``: ``ERR_REVOKED``, ``ERR_PROC_FAILED``); one under way fails
when its receives do (the engine fails them). The fault-tolerant agreement of ``ulfm`` runs as an
algorithm of its own whose receives may fail (``tolerant``): it reads their errors itself.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from vpool.mpi import errors
from vpool.mpi.constants import ANY_SOURCE, ANY_TAG
from vpool.mpi.request import RecvOp
from vpool.mpi.serialization import pickle_
from vpool.protocol.messages import KIND_BUFFER, KIND_PICKLE

Algo = Generator[list[RecvOp], None, Any]

SEGMENT = 1 << 20
"""Payloads above this size move in segments of this size through pipelined trees."""


def new_tag(h: Any) -> int:
    """The tag of a collective starting on ``h`` (every collective calls this first)."""
    if h.eng.broken:
        h.eng.enter_collective(h)
    h.cseq += 1
    return int(h.cseq)


def send_bufs(h: Any, dst: int, tag: int, bufs: list[Any]) -> None:
    """Send the concatenation of ``bufs`` (flat byte views) without joining them, to rank
    ``dst`` of the core's peers (its group; an intercommunicator's remote group)."""
    n = sum(b.nbytes if isinstance(b, memoryview) else len(b) for b in bufs)
    h.eng.send(h.peers[dst], h.ctx + 1, tag, KIND_BUFFER, [], bufs, n)


def send_obj(h: Any, dst: int, tag: int, obj: Any) -> None:
    bufs, parts = pickle_.dumps(obj)
    n = sum(parts) if parts else len(bufs[0])
    h.eng.send(h.peers[dst], h.ctx + 1, tag, KIND_PICKLE, parts, bufs, n)


def post_recv(h: Any, src: int, tag: int, view: memoryview | None) -> RecvOp:
    op = RecvOp(h.ctx + 1, h.peers[src], tag, view, h.pw2c)
    h.eng.post(op)
    return op


def loads(op: RecvOp) -> Any:
    assert op.msg is not None
    return pickle_.loads(op.payload, op.msg.parts)


def check(op: RecvOp) -> None:
    if op.error:
        raise errors.MPIException(op.error)
    view = op.view
    if view is not None and op.nbytes != view.nbytes:
        raise errors.MPIException(
            errors.ERR_TRUNCATE,
            f"collective expected {view.nbytes} bytes, got {op.nbytes}",
        )


def run(h: Any, algo: Algo, tolerant: bool = False) -> Any:
    """Drive a collective to its end inside the call (``tolerant``: failed receives are the
    algorithm's business)."""
    eng = h.eng
    try:
        pending = next(algo)
        while True:
            for op in pending:
                if not op.done:
                    eng.wait(op)
                if not tolerant:
                    check(op)
            pending = algo.send(None)
    except StopIteration as stop:
        return stop.value
    except errors.MPIException as exc:
        if exc.error_code == errors.ERR_REVOKED and h.ctx >= 0:
            eng.revoked.add(h.ctx & -2)  # observed here, in program order
        raise


class Schedule:
    """The operation of a non-blocking collective's request (see the module docstring)."""

    __slots__ = (
        "_algo",
        "_busy",
        "_done",
        "_eng",
        "_error",
        "_ft",
        "_pending",
        "_sid",
        "_tolerant",
        "result",
    )

    source = ANY_SOURCE

    def __init__(self, algo: Algo, eng: Any = None, tolerant: bool = False) -> None:
        self._algo = algo
        self._tolerant = tolerant
        self._pending: list[RecvOp] = []
        self._done = False
        self._busy = False
        self._error: BaseException | None = None
        self._eng = eng
        # Every step after the first is an asynchronous send (``ft``): logged, or replayed.
        self._ft = eng.ft if eng is not None else None
        self._sid = self._ft.new_schedule() if self._ft is not None else 0
        self.result: Any = None
        self._advance(first=True)
        if not self._done and eng is not None:
            eng.schedules.append(self)

    @property
    def done(self) -> bool:
        if not self._done:
            self._advance(first=False)
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self._done

    def step(self) -> None:
        """Advance from the engine's progress hook; an error waits for the request's owner."""
        if self._done or self._busy:
            return
        try:
            self._advance(first=False)
        except Exception as exc:  # re-raised by ``done``
            self._error = exc
            self._finish()

    def _advance(self, first: bool) -> None:
        if self._busy:
            return
        self._busy = True
        algo = self._algo
        try:
            if first:
                self._pending = next(algo)
            ft = self._ft
            while all(op.done for op in self._pending):
                if not self._tolerant:
                    for op in self._pending:
                        check(op)
                if ft is not None and not ft.may_step(self):
                    break
                self._pending = algo.send(None)
        except StopIteration as stop:
            self.result = stop.value
            self._finish()
        except BaseException:
            self._finish()
            raise
        finally:
            self._busy = False

    def _finish(self) -> None:
        self._done = True
        self._pending = []
        eng = self._eng
        if eng is not None and self in eng.schedules:
            eng.schedules.remove(self)

    def finish(self, status: Any) -> Any:
        if status is not None:
            status._fill(ANY_SOURCE, ANY_TAG, 0)
        return self.result


def start(h: Any, algo: Algo) -> Any:
    """A request for a non-blocking collective already under way."""
    from vpool.mpi.request import Request

    return Request._of(Schedule(algo, h.eng))
