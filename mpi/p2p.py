"""Point-to-point communication of communicators (mixed into ``Comm``): sends of every mode,
receives, probes and matched probes, for buffers (upper case) and pickled objects (lower case).

Ranks and contexts are translated here (communicator rank -> world rank, ``ctx`` of the
communicator's handle) and messages handed to the engine (``runtime``). Ranks name the handle's
``peers``: its group, or an intercommunicator's remote group (``pw2c`` maps world ranks back
for statuses). Standard, buffered and ready sends are eager: complete once handed to the
transport. Synchronous sends complete when the receiver matched the message (``Engine.ssend``).
"""

from __future__ import annotations

import warnings
from typing import Any

from vpool.mpi import errors
from vpool.mpi.buffers import recv_view, view_of
from vpool.mpi.constants import ANY_SOURCE, ANY_TAG, PROC_NULL, TAG_UB_VALUE
from vpool.mpi.envelope import as_rank
from vpool.mpi.request import PROC_NULL_RECV, DoneOp, Prequest, RecvOp, Request
from vpool.mpi.serialization import pickle_
from vpool.mpi.status import Status
from vpool.protocol.messages import KIND_BUFFER, KIND_PICKLE
from vpool.protocol.rank_ft import K_PROBE

_dumps = pickle_.dumps


def _rank_error(rank: int, h: Any) -> errors.MPIException:
    return errors.MPIException(errors.ERR_RANK, f"rank {rank} of a {h.psize}-rank communicator")


def _dst(h: Any, dest: Any) -> int:
    """World rank of a destination, or -1 for PROC_NULL."""
    if h.eng.broken:
        h.eng.enter(h)  # ULFM: a revoked communicator refuses every call, PROC_NULL too
    dest = as_rank(dest)
    if 0 <= dest < h.psize:
        return h.peers[dest]
    if dest == PROC_NULL:
        return -1
    raise _rank_error(dest, h)


def _src(h: Any, source: Any) -> int:
    """World rank of a source, ANY_SOURCE or PROC_NULL."""
    source = as_rank(source)
    if h.eng.broken or source == ANY_SOURCE:
        h.eng.enter(h, source == ANY_SOURCE)  # ULFM: revoked? (and ANY_SOURCE's communicator)
    if 0 <= source < h.psize:
        return h.peers[source]
    if source == ANY_SOURCE or source == PROC_NULL:
        return source
    raise _rank_error(source, h)


def _send_tag(tag: int) -> None:
    if not 0 <= tag <= TAG_UB_VALUE:
        raise errors.MPIException(errors.ERR_TAG, f"tag {tag}")


def _recv_tag(tag: int) -> None:
    if not (0 <= tag <= TAG_UB_VALUE or tag == ANY_TAG):
        raise errors.MPIException(errors.ERR_TAG, f"tag {tag}")


class CommP2P:
    _h: Any

    def _core(self) -> Any:
        raise NotImplementedError

    # ---- point-to-point: buffers -----------------------------------------------------------

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:
        h = self._h or self._core()
        w = _dst(h, dest)
        _send_tag(tag)
        if w < 0:
            return
        view = view_of(buf, writable=False)
        h.eng.send(w, h.ctx, tag, KIND_BUFFER, [], [view], view.nbytes)

    Bsend = Send
    Rsend = Send

    def Ssend(self, buf: Any, dest: int, tag: int = 0) -> None:
        self.Issend(buf, dest, tag).Wait()

    def Isend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        self.Send(buf, dest, tag)
        return Request._of(DoneOp())

    Ibsend = Isend
    Irsend = Isend

    def Issend(self, buf: Any, dest: int, tag: int = 0) -> Request:
        h = self._h or self._core()
        w = _dst(h, dest)
        _send_tag(tag)
        if w < 0:
            return Request._of(DoneOp())
        view = view_of(buf, writable=False)
        return Request._of(h.eng.ssend(w, h.ctx, tag, KIND_BUFFER, [], [view], view.nbytes))

    def Send_init(self, buf: Any, dest: int, tag: int = 0) -> Prequest:
        return Prequest._persistent(lambda: self.Isend(buf, dest, tag)._op)

    def Ssend_init(self, buf: Any, dest: int, tag: int = 0) -> Prequest:
        return Prequest._persistent(lambda: self.Issend(buf, dest, tag)._op)

    Bsend_init = Send_init
    Rsend_init = Send_init

    def _post_recv(self, buf: Any, source: int, tag: int) -> Any:
        h = self._h or self._core()
        w = _src(h, source)
        _recv_tag(tag)
        if w == PROC_NULL:
            return PROC_NULL_RECV
        view, unpack = recv_view(buf)
        op = RecvOp(h.ctx, w, tag, view, h.pw2c)
        op.unpack = unpack
        h.eng.post(op)
        return op

    def Recv(
        self,
        buf: Any,
        source: int = ANY_SOURCE,
        tag: int = ANY_TAG,
        status: Status | None = None,
    ) -> None:
        op = self._post_recv(buf, source, tag)
        if not op.done:
            self._h.eng.wait(op)  # type: ignore[union-attr]
        op.finish(status)

    def Irecv(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        return Request._of(self._post_recv(buf, source, tag))

    def Recv_init(self, buf: Any, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Prequest:
        return Prequest._persistent(lambda: self._post_recv(buf, source, tag))

    def Sendrecv(
        self,
        sendbuf: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = ANY_SOURCE,
        recvtag: int = ANY_TAG,
        status: Status | None = None,
    ) -> None:
        op = self._post_recv(recvbuf, source, recvtag)
        self.Send(sendbuf, dest, sendtag)
        if not op.done:
            self._h.eng.wait(op)  # type: ignore[union-attr]
        op.finish(status)

    def Sendrecv_replace(
        self,
        buf: Any,
        dest: int,
        sendtag: int = 0,
        source: int = ANY_SOURCE,
        recvtag: int = ANY_TAG,
        status: Status | None = None,
    ) -> None:
        # Sends are eager: once Send returns the bytes are gone, the buffer may be received into.
        self.Send(buf, dest, sendtag)
        self.Recv(buf, source, recvtag, status)

    def Isendrecv(
        self,
        sendbuf: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = ANY_SOURCE,
        recvtag: int = ANY_TAG,
    ) -> Request:
        op = self._post_recv(recvbuf, source, recvtag)
        self.Send(sendbuf, dest, sendtag)
        return Request._of(op)

    def Isendrecv_replace(
        self,
        buf: Any,
        dest: int,
        sendtag: int = 0,
        source: int = ANY_SOURCE,
        recvtag: int = ANY_TAG,
    ) -> Request:
        recv_view(buf)  # a bad receive buffer must fail before anything is sent
        self.Send(buf, dest, sendtag)  # eager: the bytes are out before the receive is posted
        return Request._of(self._post_recv(buf, source, recvtag))

    # ---- point-to-point: objects -----------------------------------------------------------

    def send(self, obj: Any, dest: int, tag: int = 0) -> None:
        h = self._h or self._core()
        if (
            type(dest) is int
            and 0 <= dest < h.psize
            and 0 <= tag <= TAG_UB_VALUE
            and not h.eng.broken
        ):
            w = h.peers[dest]
        else:
            w = _dst(h, dest)
            _send_tag(tag)
            if w < 0:
                return
        bufs, parts = _dumps(obj)
        h.eng.send(w, h.ctx, tag, KIND_PICKLE, parts, bufs, sum(parts) if parts else len(bufs[0]))

    bsend = send

    def ssend(self, obj: Any, dest: int, tag: int = 0) -> None:
        self.issend(obj, dest, tag).wait()

    def isend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        self.send(obj, dest, tag)
        return Request._of(DoneOp())

    ibsend = isend

    def issend(self, obj: Any, dest: int, tag: int = 0) -> Request:
        h = self._h or self._core()
        w = _dst(h, dest)
        _send_tag(tag)
        if w < 0:
            return Request._of(DoneOp())
        bufs, parts = _dumps(obj)
        n = sum(parts) if parts else len(bufs[0])
        return Request._of(h.eng.ssend(w, h.ctx, tag, KIND_PICKLE, parts, bufs, n))

    def _post_obj(self, source: int, tag: int) -> Any:
        h = self._h or self._core()
        if type(source) is int and 0 <= source < h.psize:
            w = h.peers[source]
        else:
            w = _src(h, source)
            if w == PROC_NULL:
                return PROC_NULL_RECV
        if tag < 0 and tag != ANY_TAG:
            _recv_tag(tag)
        op = RecvOp(h.ctx, w, tag, None, h.pw2c)
        h.eng.post(op)
        return op

    def recv(
        self,
        buf: Any = None,
        source: int = ANY_SOURCE,
        tag: int = ANY_TAG,
        status: Status | None = None,
    ) -> Any:
        if buf is not None:
            warnings.warn("the 'buf' argument is deprecated", UserWarning, stacklevel=2)
        op = self._post_obj(source, tag)
        if not op.done:
            self._h.eng.wait(op)  # type: ignore[union-attr]
        return op.finish(status)

    def irecv(self, buf: Any = None, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> Request:
        return Request._of(self._post_obj(source, tag))

    def sendrecv(
        self,
        sendobj: Any,
        dest: int,
        sendtag: int = 0,
        recvbuf: Any = None,
        source: int = ANY_SOURCE,
        recvtag: int = ANY_TAG,
        status: Status | None = None,
    ) -> Any:
        op = self._post_obj(source, recvtag)
        self.send(sendobj, dest, sendtag)
        if not op.done:
            self._h.eng.wait(op)  # type: ignore[union-attr]
        return op.finish(status)

    # ---- probes ----------------------------------------------------------------------------

    def _probe(self, source: int, tag: int, block: bool) -> Any:
        h = self._core()
        w = _src(h, source)
        _recv_tag(tag)
        if w == PROC_NULL:
            return PROC_NULL
        eng = h.eng
        matcher = eng.matcher
        ctx = h.ctx
        if block and w != ANY_SOURCE:
            # Deterministic: the earliest matching message of one channel (FIFO).
            entry = matcher.probe(ctx, w, tag)
            if entry is None:
                eng.poke()
                entry = matcher.probe(ctx, w, tag)
                while entry is None:
                    eng.block()
                    entry = matcher.probe(ctx, w, tag)
            return eng.probed(entry)  # ULFM: a revocation notice is not a message

        def live() -> int | None:
            entry = matcher.probe(ctx, w, tag)
            if entry is None:
                eng.poke()
                entry = matcher.probe(ctx, w, tag)
                while entry is None and block:
                    eng.block()
                    entry = matcher.probe(ctx, w, tag)
            return None if entry is None else int(entry[0].src)

        # Whether (and from whom) a message is there is a determinant (``ft``).
        src = eng.ft.decide(K_PROBE, live, lambda s: matcher.probe(ctx, s, tag) is not None)
        if src is None:
            return None
        return eng.probed(matcher.probe(ctx, src, tag))

    def _probe_status(self, entry: Any, status: Status | None) -> None:
        if status is None:
            return
        if entry is PROC_NULL:
            status._fill(PROC_NULL, ANY_TAG, 0)
        else:
            msg, payload = entry
            status._fill(self._core().pw2c[msg.src], msg.tag, len(payload))

    def Probe(
        self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None
    ) -> bool:
        self._probe_status(self._probe(source, tag, True), status)
        return True

    def Iprobe(
        self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None
    ) -> bool:
        entry = self._probe(source, tag, False)
        if entry is None:
            return False
        self._probe_status(entry, status)
        return True

    probe = Probe
    iprobe = Iprobe

    def _mprobe(self, source: int, tag: int, block: bool, status: Status | None) -> Any:
        from vpool.mpi.message import MESSAGE_NO_PROC, Message

        entry = self._probe(source, tag, block)
        if entry is None:
            return None
        self._probe_status(entry, status)
        if entry is PROC_NULL:
            return Message(MESSAGE_NO_PROC)
        h = self._core()
        h.eng.claim(entry)
        return Message._of(entry, h.pw2c)

    def Mprobe(
        self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None
    ) -> Any:
        return self._mprobe(source, tag, True, status)

    def Improbe(
        self, source: int = ANY_SOURCE, tag: int = ANY_TAG, status: Status | None = None
    ) -> Any:
        return self._mprobe(source, tag, False, status)

    mprobe = Mprobe
    improbe = Improbe
