"""Requests: the internal operations behind them and mpi4py's ``Request`` API.

An operation has ``done`` and ``finish(status) -> result``; ``finish`` raises the operation's
MPI error, fills the status and returns the received object for lower-case receives.

- ``RecvOp``: a posted receive (buffer or pickled), completed by the matcher;
- ``DoneOp``: already complete (sends are eager; blocking-then-complete collectives).

Completion order is decided in one place per call (``Waitany``/``Testany``/``Waitsome``): the
lowest index among completed requests, so the choice depends only on which messages arrived.
Which had arrived is a matter of timing: every such outcome (and every test of a request that
is not trivially complete) is a determinant (``rank_ft.FT.decide``): logged live, obeyed on replay.

Failures (ULFM): waiting on or testing a receive from ANY_SOURCE that a failure left pending
raises ``ERR_PROC_FAILED_PENDING`` and leaves the request as it is (``Engine.wait``); a receive
that fails with ``ERR_REVOKED`` tells the engine its communicator is revoked (the point where the
program observes it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vpool.mpi import errors
from vpool.mpi.constants import ANY_SOURCE, ANY_TAG, PROC_NULL, UNDEFINED
from vpool.mpi.serialization import pickle_
from vpool.mpi.status import Status
from vpool.protocol.messages import Data
from vpool.protocol.rank_ft import K_ANY, K_SOME, K_TEST


class RecvOp:
    """A posted receive on context ``ctx`` from world rank ``src`` (or ANY_SOURCE) with ``tag``.

    ``view`` is the flat byte view of the user's buffer, or None for a pickled receive.
    ``w2c`` maps world ranks to the communicator's ranks for the status."""

    __slots__ = (
        "cancelled",
        "ctx",
        "done",
        "error",
        "msg",
        "nbytes",
        "payload",
        "src",
        "tag",
        "unpack",
        "view",
        "w2c",
    )

    def __init__(self, ctx: int, src: int, tag: int, view: memoryview | None, w2c: Any) -> None:
        self.ctx = ctx
        self.src = src
        self.tag = tag
        self.view = view
        self.w2c = w2c
        self.done = False
        self.cancelled = False
        self.error = errors.SUCCESS
        self.msg: Data | None = None
        self.payload: Any = None
        self.nbytes = 0
        # A receive into a non-contiguous datatype lands in a packed ``view``: this scatters
        # it into the user's buffer when the receive is finished (``buffers.recv_view``).
        self.unpack: Callable[[], None] | None = None

    def complete(self, msg: Data, payload: Any) -> None:
        """Matched with an owned payload (bytes, bytearray or a view of one)."""
        self.msg = msg
        n = len(payload)
        self.nbytes = n
        view = self.view
        if view is None:
            self.payload = payload
        elif n > view.nbytes:
            self.error = errors.ERR_TRUNCATE
            view[:] = memoryview(payload)[: view.nbytes]
        elif n:
            view[:n] = payload
        self.done = True

    def complete_view(self, msg: Data, view: memoryview) -> None:
        """Matched with a view the transport reuses after this call: keep a copy."""
        if self.view is None:
            self.msg = msg
            self.nbytes = len(view)
            self.payload = bytearray(view) if msg.parts else bytes(view)
            self.done = True
        else:
            self.complete(msg, view)

    def direct(self, nbytes: int) -> memoryview | None:
        """Where a large payload may be read straight into, if the user's buffer fits it."""
        view = self.view
        if view is not None and nbytes <= view.nbytes:
            return view[:nbytes]
        return None

    def complete_direct(self, msg: Data, nbytes: int) -> None:
        self.msg = msg
        self.nbytes = nbytes
        self.done = True

    def fill(self, status: Status) -> None:
        msg = self.msg
        if msg is None:
            status._fill(ANY_SOURCE, ANY_TAG, 0, self.error)
            status._cancelled = self.cancelled
        else:
            status._fill(self.w2c[msg.src], msg.tag, self.nbytes, self.error)

    def finish(self, status: Status | None) -> Any:
        if status is not None:
            self.fill(status)
        if self.unpack is not None and self.msg is not None:
            unpack, self.unpack = self.unpack, None
            unpack()
        if self.error:
            if self.error == errors.ERR_REVOKED and self.ctx >= 0:
                _engine().revoked.add(self.ctx & -2)
            raise errors.MPIException(self.error)
        if self.view is None and self.msg is not None and self.nbytes:
            # An empty message (e.g. ``Send([None, 0, "B"])``) is None, as in mpi4py.
            return pickle_.loads(self.payload, self.msg.parts)
        return None


class DoneOp:
    """A complete operation: eager sends, PROC_NULL receives, blocking collectives."""

    __slots__ = ("result", "source")

    done = True

    def __init__(self, result: Any = None, source: int = ANY_SOURCE) -> None:
        self.result = result
        self.source = source

    def finish(self, status: Status | None) -> Any:
        if status is not None:
            status._fill(self.source, ANY_TAG, 0)
        return self.result


SEND_DONE = DoneOp()
PROC_NULL_RECV = DoneOp(source=PROC_NULL)


def _engine() -> Any:
    from vpool.mpi import environment

    return environment.engine()


_handles: dict[int, Request] = {}  # handles handed out by ``Request.handle``, for fromhandle


class Request:
    """``MPI.Request``. A null request (``REQUEST_NULL``) has no operation.

    ``_op`` is the active operation; ``_start`` makes a new one for persistent requests, whose
    identity (handle) it is: an inactive persistent request is not null."""

    __slots__ = ("_op", "_start")

    def __init__(self, request: Request | None = None) -> None:
        if request is not None and not isinstance(request, Request):
            raise TypeError(f"expected a Request, got {type(request).__name__}")
        self._op: Any = request._op if request is not None else None
        self._start: Callable[[], Any] | None = request._start if request is not None else None

    @classmethod
    def _of(cls, op: Any) -> Request:
        req = cls.__new__(cls)
        req._op = op
        req._start = None
        return req

    def _key(self) -> Any:
        return self._start if self._start is not None else self._op

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Request):
            return NotImplemented
        return self._key() is other._key()

    def __hash__(self) -> int:
        return id(self._key())

    def __bool__(self) -> bool:
        return self._key() is not None

    def __repr__(self) -> str:
        return f"<mpi4py.MPI.{type(self).__name__} {'null' if not self else 'active'}>"

    @property
    def handle(self) -> int:
        key = self._key()
        if key is None:
            return 0
        _handles[id(key)] = self
        return id(key)

    @classmethod
    def fromhandle(cls, handle: int) -> Any:
        obj = cls.__new__(cls)
        src = _handles.get(handle)
        obj._op = src._op if src is not None else None
        obj._start = src._start if src is not None else None
        return obj

    def toint(self) -> int:
        return self.handle

    def py2f(self) -> int:
        return self.handle

    @classmethod
    def fromint(cls, value: int) -> Any:
        return cls.fromhandle(value)

    @classmethod
    def f2py(cls, value: int) -> Any:
        return cls.fromhandle(value)

    # ---- one request ---------------------------------------------------------------------

    def _complete(self, status: Status | None) -> Any:
        op = self._op
        if op is None:
            if status is not None:
                status._fill(ANY_SOURCE, ANY_TAG, 0)
            return None
        if not op.done:
            _engine().wait(op, request=True)
        self._release()
        return op.finish(status)

    def _release(self) -> None:
        # A completed persistent request becomes inactive, not null: it may be started again.
        self._op = None

    def _test(self) -> bool:
        op = self._op
        if op is None or type(op) is DoneOp:
            return True
        eng = _engine()

        def live() -> bool | None:
            if op.done:
                return True
            eng.poke()
            if op.done:
                return True
            if eng.failed and eng.pending_failure(op):
                raise errors.MPIException(errors.ERR_PROC_FAILED_PENDING)
            return None

        return eng.ft.decide(K_TEST, live, lambda _: op.done) is not None

    def Wait(self, status: Status | None = None) -> bool:
        self._complete(status)
        return True

    def Test(self, status: Status | None = None) -> bool:
        if not self._test():
            return False
        self._complete(status)
        return True

    def wait(self, status: Status | None = None) -> Any:
        return self._complete(status)

    def test(self, status: Status | None = None) -> tuple[bool, Any]:
        if not self._test():
            return (False, None)
        return (True, self._complete(status))

    def Get_status(self, status: Status | None = None) -> bool:
        if not self._test():
            return False
        op = self._op
        if status is not None:
            if op is None:
                status._fill(ANY_SOURCE, ANY_TAG, 0)
            elif isinstance(op, RecvOp):
                op.fill(status)
            else:
                status._fill(getattr(op, "source", ANY_SOURCE), ANY_TAG, 0)
        return True

    def get_status(self, status: Status | None = None) -> bool:
        return self.Get_status(status)

    def Cancel(self) -> None:
        if not self:
            raise errors.MPIException(errors.ERR_REQUEST, "null request")
        op = self._op
        if isinstance(op, RecvOp) and not op.done and _engine().matcher.cancel(op):
            op.cancelled = True
            op.done = True
        elif hasattr(op, "cancel"):
            op.cancel()

    def cancel(self) -> None:
        self.Cancel()

    def Free(self) -> None:
        # A freed receive still completes eventually: it stays posted, its result is dropped.
        if not self:
            raise errors.MPIException(errors.ERR_REQUEST, "null request")
        self._op = None
        self._start = None

    def free(self) -> None:
        if self:
            self.Free()

    # ---- many requests -------------------------------------------------------------------

    @classmethod
    def Waitall(cls, requests: Sequence[Request], statuses: list[Status] | None = None) -> bool:
        _waitall(requests, statuses)
        return True

    @classmethod
    def waitall(
        cls, requests: Sequence[Request], statuses: list[Status] | None = None
    ) -> list[Any]:
        return _waitall(requests, statuses)

    @classmethod
    def Testall(cls, requests: Sequence[Request], statuses: list[Status] | None = None) -> bool:
        return _testall(requests, statuses)[0]

    @classmethod
    def testall(
        cls, requests: Sequence[Request], statuses: list[Status] | None = None
    ) -> tuple[bool, list[Any] | None]:
        return _testall(requests, statuses)

    @classmethod
    def Waitany(cls, requests: Sequence[Request], status: Status | None = None) -> int:
        return _waitany(requests, status)[0]

    @classmethod
    def waitany(cls, requests: Sequence[Request], status: Status | None = None) -> tuple[int, Any]:
        return _waitany(requests, status)

    @classmethod
    def Testany(cls, requests: Sequence[Request], status: Status | None = None) -> tuple[int, bool]:
        index, flag, _ = _testany(requests, status)
        return index, flag

    @classmethod
    def testany(
        cls, requests: Sequence[Request], status: Status | None = None
    ) -> tuple[int, bool, Any]:
        return _testany(requests, status)

    @classmethod
    def Waitsome(
        cls, requests: Sequence[Request], statuses: list[Status] | None = None
    ) -> list[int] | None:
        return _some(requests, statuses, block=True)[0]

    @classmethod
    def waitsome(
        cls, requests: Sequence[Request], statuses: list[Status] | None = None
    ) -> tuple[list[int] | None, list[Any] | None]:
        return _some(requests, statuses, block=True)

    @classmethod
    def Testsome(
        cls, requests: Sequence[Request], statuses: list[Status] | None = None
    ) -> list[int] | None:
        return _some(requests, statuses, block=False)[0]

    @classmethod
    def testsome(
        cls, requests: Sequence[Request], statuses: list[Status] | None = None
    ) -> tuple[list[int] | None, list[Any] | None]:
        return _some(requests, statuses, block=False)

    @classmethod
    def Startall(cls, requests: Sequence[Prequest]) -> None:
        for req in requests:
            req.Start()

    # ---- status without completion (MPI 4.1) ------------------------------------------------

    @classmethod
    def Get_status_any(
        cls, requests: Sequence[Request], status: Status | None = None
    ) -> tuple[int, bool]:
        index, found = _any(requests, block=False)
        if found and status is not None:
            if index == UNDEFINED:
                status._fill(ANY_SOURCE, ANY_TAG, 0)
            else:
                requests[index].Get_status(status)
        return index, found

    get_status_any = Get_status_any

    @classmethod
    def Get_status_all(cls, requests: Sequence[Request], statuses: Any = None) -> bool:
        if not all(r._test() for r in requests):
            return False
        for req, st in zip(requests, _statuses(statuses, len(requests)), strict=True):
            req.Get_status(st)
        return True

    get_status_all = Get_status_all

    @classmethod
    def Get_status_some(cls, requests: Sequence[Request], statuses: Any = None) -> list[int] | None:
        if not any(r._op is not None for r in requests):
            return None
        done = _done_some(requests, block=False)
        for i, st in zip(done, _statuses(statuses, len(done)), strict=True):
            requests[i].Get_status(st)
        return done

    get_status_some = Get_status_some


def _statuses(statuses: Any, n: int) -> list[Status | None]:
    """The first ``n`` statuses to fill, as mpi4py does: a short list grows, a tuple does not."""
    if statuses is None:
        return [None] * n
    if isinstance(statuses, list):
        while len(statuses) < n:
            statuses.append(Status())
    have = list(statuses[:n])
    return have + [None] * (n - len(have))


def _waitall(requests: Sequence[Request], statuses: list[Status] | None) -> list[Any]:
    sts = _statuses(statuses, len(requests))
    results = []
    failed = None
    for req, st in zip(requests, sts, strict=True):
        try:
            results.append(req._complete(st))
        except errors.MPIException as exc:
            failed = failed or exc
            results.append(None)
    if failed is not None:
        raise errors.MPIException(errors.ERR_IN_STATUS, str(failed))
    return results


def _testall(
    requests: Sequence[Request], statuses: list[Status] | None
) -> tuple[bool, list[Any] | None]:
    active = [r._op for r in requests if r._op is not None and type(r._op) is not DoneOp]
    if active:
        eng = _engine()

        def all_done() -> bool:
            return all(op.done for op in active)

        def live() -> bool | None:
            if all_done():
                return True
            eng.poke()
            return True if all_done() else None

        if eng.ft.decide(K_TEST, live, lambda _: all_done()) is None:
            return (False, None)
    return (True, _waitall(requests, statuses))


def _first_done(requests: Sequence[Request]) -> tuple[int, bool]:
    """Lowest index of a completed request; (UNDEFINED, True) when all are null."""
    active = False
    for i, req in enumerate(requests):
        op = req._op
        if op is not None:
            if op.done:
                return i, True
            active = True
    return UNDEFINED, not active


def _any(requests: Sequence[Request], block: bool) -> tuple[int, bool]:
    """Which request completes first (a determinant): (index, True), (UNDEFINED, True) when all
    are null, (UNDEFINED, False) when none is complete and ``block`` is false."""
    if all(r._op is None for r in requests):
        return UNDEFINED, True
    eng = _engine()

    def live() -> int | None:
        index, found = _first_done(requests)
        if not found:
            eng.poke()
            index, found = _first_done(requests)
            while block and not found:
                _check_pending(eng, requests)
                eng.block()
                index, found = _first_done(requests)
        if not found:
            _check_pending(eng, requests)
        return index if found else None

    def ready(index: int) -> bool:
        op = requests[index]._op
        return op is None or bool(op.done)

    index = eng.ft.decide(K_ANY, live, ready)
    if index is None:
        return UNDEFINED, False
    return int(index), True


def _done_some(requests: Sequence[Request], block: bool) -> list[int]:
    """Indices of the complete requests (a determinant); some are active."""
    eng = _engine()

    def done_now() -> list[int]:
        return [i for i, r in enumerate(requests) if r._op is not None and r._op.done]

    def live() -> list[int] | None:
        done = done_now()
        if not done:
            eng.poke()
            done = done_now()
            while block and not done:
                _check_pending(eng, requests)
                eng.block()
                done = done_now()
        if not done:
            _check_pending(eng, requests)
        return done or None

    def ready(done: list[int]) -> bool:
        return all(requests[i]._op is None or requests[i]._op.done for i in done)

    return list(eng.ft.decide(K_SOME, live, ready) or [])


def _check_pending(eng: Any, requests: Sequence[Request]) -> None:
    """None of ``requests`` is complete: raise if a failure leaves one pending for good."""
    if eng.failed:
        for req in requests:
            if req._op is not None and eng.pending_failure(req._op):
                raise errors.MPIException(errors.ERR_PROC_FAILED_PENDING)


def _waitany(requests: Sequence[Request], status: Status | None) -> tuple[int, Any]:
    index, _ = _any(requests, block=True)
    if index == UNDEFINED:
        if status is not None:
            status._fill(ANY_SOURCE, ANY_TAG, 0)
        return UNDEFINED, None
    return index, requests[index]._complete(status)


def _testany(requests: Sequence[Request], status: Status | None) -> tuple[int, bool, Any]:
    index, found = _any(requests, block=False)
    if not found:
        return UNDEFINED, False, None
    if index == UNDEFINED:
        if status is not None:
            status._fill(ANY_SOURCE, ANY_TAG, 0)
        return UNDEFINED, True, None
    return index, True, requests[index]._complete(status)


def _some(
    requests: Sequence[Request], statuses: list[Status] | None, block: bool
) -> tuple[list[int] | None, list[Any] | None]:
    if not any(r._op is not None for r in requests):
        return None, None
    done = _done_some(requests, block)
    sts = _statuses(statuses, len(done))
    results = [requests[i]._complete(st) for i, st in zip(done, sts, strict=True)]
    return done, results


class Prequest(Request):
    """``MPI.Prequest``: a persistent request; ``Start`` runs the operation again."""

    __slots__ = ()

    @classmethod
    def _persistent(cls, start: Callable[[], Any]) -> Prequest:
        req = cls.__new__(cls)
        req._op = None
        req._start = start
        return req

    def Start(self) -> None:
        if self._start is None:
            raise errors.MPIException(errors.ERR_REQUEST)
        self._op = self._start()

    def start(self) -> None:
        self.Start()

    def Free(self) -> None:
        if not self:
            raise errors.MPIException(errors.ERR_REQUEST, "null request")
        self._op = None
        self._start = None

    @classmethod
    def Startall(cls, requests: Sequence[Prequest]) -> None:
        for req in requests:
            req.Start()


REQUEST_NULL = Request()
