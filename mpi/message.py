"""``MPI.Message``: a message taken out of the matching queue by a matched probe (``Mprobe``)."""

from __future__ import annotations

from typing import Any

from vpool.mpi import errors
from vpool.mpi.buffers import recv_view
from vpool.mpi.constants import ANY_TAG
from vpool.mpi.request import PROC_NULL_RECV, RecvOp, Request
from vpool.mpi.status import Status


class Message:
    __slots__ = ("_entry", "_noproc", "_w2c")

    def __init__(self, message: Message | None = None) -> None:
        self._entry: Any = message._entry if message is not None else None
        self._w2c: Any = message._w2c if message is not None else None
        self._noproc = message._noproc if message is not None else False

    @classmethod
    def _of(cls, entry: Any, w2c: Any) -> Message:
        m = cls.__new__(cls)
        m._entry, m._w2c, m._noproc = entry, w2c, False
        return m

    def __bool__(self) -> bool:
        return self._entry is not None or self._noproc

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        return self._entry is other._entry and self._noproc == other._noproc

    def __hash__(self) -> int:
        return id(self._entry)

    def _take(self, view: memoryview | None) -> Any:
        if self._noproc:
            self._noproc = False
            return PROC_NULL_RECV
        if self._entry is None:
            raise errors.MPIException(errors.ERR_REQUEST, "null message")
        msg, payload = self._entry
        self._entry = None
        op = RecvOp(msg.ctx, msg.src, msg.tag, view, self._w2c)
        op.complete(msg, payload)
        return op

    def Recv(self, buf: Any, status: Status | None = None) -> None:
        self._take_into(buf).finish(status)

    def Irecv(self, buf: Any) -> Request:
        return Request._of(self._take_into(buf))

    def _take_into(self, buf: Any) -> Any:
        view, unpack = recv_view(buf)
        op = self._take(view)
        if isinstance(op, RecvOp):
            op.unpack = unpack
        return op

    def recv(self, status: Status | None = None) -> Any:
        return self._take(None).finish(status)

    def irecv(self) -> Request:
        return Request._of(self._take(None))

    @classmethod
    def Probe(cls, comm: Any, source: int = -2, tag: int = ANY_TAG, status: Any = None) -> Message:
        return comm.Mprobe(source, tag, status)  # type: ignore[no-any-return]

    @classmethod
    def Iprobe(cls, comm: Any, source: int = -2, tag: int = ANY_TAG, status: Any = None) -> Any:
        return comm.Improbe(source, tag, status)

    probe = Probe
    iprobe = Iprobe


MESSAGE_NULL = Message()
MESSAGE_NO_PROC = Message()
MESSAGE_NO_PROC._noproc = True
