"""The relay's store process: checkpoint store connections served in threads, niced.

``python -m vpool.relay.storeworker NICE FD``: started by the relay (``storesupervisor``) with
its end of the link (``storelink``) as ``FD``. It starts at the relay's priority, so that its
imports take a fraction of a second even while ranks keep every core busy, then lowers its
own (``store_nice``) before it reads anything: every thread it starts inherits that.

The main thread reads the link: each ``Conn`` brings a socket, served by a ``StoreThread``
in a thread of its own; each ``Reply`` wakes the thread that made the ``Call``. A session
thread asks through ``RelayLink``'s methods, one per request (``storelink``), each of which
takes its typed answer apart; an answer of another type than its request's ends the session
like a link that is gone (``LinkClosed``), and a packet that does not decode ends the link,
like one that is truncated. When the link
ends (the relay stopped or died), every connection is shut down, which ends the threads'
blocking calls (an interrupted upload deletes its part file), and the process exits once they
are done, or after ``EXIT_WAIT`` in any case. SIGINT is ignored: the process shares the
relay's process group, and the relay decides when it ends.
"""

from __future__ import annotations

import itertools
import logging
import signal
import socket
import ssl
import sys
import threading
import time
from pathlib import Path

import msgspec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from vpool import tls
from vpool.niceness import lower_this_process
from vpool.protocol.relay_core import Refused
from vpool.protocol.tokens import RankClaims
from vpool.relay.ckptstore import Image, Key
from vpool.relay.storelink import (
    MAX_PACKET,
    Answer,
    BeginPut,
    Call,
    Commit,
    Committed,
    Conn,
    Done,
    Ended,
    EndUpload,
    Found,
    Granted,
    ImageAsk,
    Init,
    JobFinished,
    JobState,
    NoAnswer,
    NotFound,
    Refusal,
    Reply,
    Request,
    SigningKey,
    SigningKeyAsk,
    encode,
    received_fds,
    to_worker,
)
from vpool.relay.storethread import StoreThread

logger = logging.getLogger(__name__)

# How long the process waits for its sessions to end once the link is gone.
EXIT_WAIT = 10.0


class LinkClosed(OSError):
    """The relay is gone, or has no answer for this session any more."""


class _Pending:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Answer | None = None
        self.error = ""  # the link ended before the answer came


class RelayLink:
    """The store process's side of the link: calls from session threads, and the main loop."""

    def __init__(self, sock: socket.socket, init: Init) -> None:
        self.sock = sock
        self.init = init
        self._lock = threading.Lock()  # sends, ``_pending``, ``_closed``, ``_sessions``
        self._rids = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._closed = False
        self._sessions: dict[int, tuple[threading.Thread, socket.socket]] = {}

    # -- calls (session threads) --------------------------------------------------------------

    def _send(self, msg: Call | Ended) -> None:
        with self._lock:
            if self._closed:
                raise LinkClosed("the relay is gone")
            self.sock.send(encode(msg))

    def call(self, cid: int, request: Request) -> Answer:
        """Ask the relay ``request`` for session ``cid`` and wait for its answer; LinkClosed
        if the relay is gone or has none (``NoAnswer``)."""
        pending = _Pending()
        with self._lock:
            if self._closed:
                raise LinkClosed("the relay is gone")
            rid = next(self._rids)
            self._pending[rid] = pending
            try:
                self.sock.send(encode(Call(rid=rid, cid=cid, request=request)))
            except OSError:
                del self._pending[rid]
                raise
        pending.done.wait()
        answer = pending.value
        if pending.error or answer is None:
            raise LinkClosed(pending.error or "the relay is gone")
        if isinstance(answer, NoAnswer):
            raise LinkClosed(answer.error)
        return answer

    def signing_key(self, cid: int) -> Ed25519PublicKey | None:
        answer = self.call(cid, SigningKeyAsk())
        if not isinstance(answer, SigningKey):
            raise _unexpected(SigningKeyAsk, answer)
        return None if answer.raw is None else Ed25519PublicKey.from_public_bytes(answer.raw)

    def begin_put(self, cid: int, claims: RankClaims, ckpt: int) -> Refused | None:
        job, rank = claims.job, claims.rank
        request = BeginPut(job=job, rank=rank, incarnation=claims.incarnation, ckpt=ckpt)
        match answer := self.call(cid, request):
            case Granted():
                return None
            case Refusal():
                return _rejected(answer, job, rank)
        raise _unexpected(BeginPut, answer)

    def end_upload(self, cid: int, key: Key) -> None:
        job, rank = key
        answer = self.call(cid, EndUpload(job=job, rank=rank))
        if not isinstance(answer, Done):
            raise _unexpected(EndUpload, answer)

    def job_finished(self, cid: int, job: int) -> bool:
        answer = self.call(cid, JobFinished(job=job))
        if not isinstance(answer, JobState):
            raise _unexpected(JobFinished, answer)
        return answer.finished

    def commit(self, cid: int, img: Image, wait: float) -> tuple[Refused | list[int], bool | None]:
        """Commit an image on disk, and wait (at most ``wait`` s) for the coordinator to know
        it: (the ids retained, or why it was refused; whether the coordinator accepted it)."""
        request = Commit(manifest=img.to_json(), directory=str(img.directory), wait=wait)
        match answer := self.call(cid, request):
            case Committed(retained=retained, known=known):
                return retained, known
            case Refusal():
                return _rejected(answer, img.job, img.rank), None
        raise _unexpected(Commit, answer)

    def image(self, cid: int, key: Key, ckpt: int) -> Image | None:
        job, rank = key
        match answer := self.call(cid, ImageAsk(job=job, rank=rank, ckpt=ckpt)):
            case Found(manifest=manifest, directory=directory):
                return Image.from_json(manifest, Path(directory))
            case NotFound():
                return None
        raise _unexpected(ImageAsk, answer)

    # -- the main loop ------------------------------------------------------------------------

    def serve(self, ssl_context: ssl.SSLContext | None) -> None:
        """Read the link until it ends, then end every session."""
        try:
            while True:
                try:
                    data, ancdata, flags, _ = self.sock.recvmsg(MAX_PACKET, socket.CMSG_SPACE(16))
                except ConnectionResetError:
                    return  # the relay closed the link with packets of ours unread
                fds = received_fds(ancdata)
                if not data:
                    return
                if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                    logger.error("store process: a link packet was truncated; stopping")
                    return
                try:
                    msg = to_worker.decode(data)
                except msgspec.DecodeError as exc:
                    logger.error("store process: bad link packet (%s); stopping", exc)
                    for fd in fds:
                        socket.socket(fileno=fd).close()
                    return
                if isinstance(msg, Reply):
                    with self._lock:
                        pending = self._pending.pop(msg.rid, None)
                    if pending is not None:
                        pending.value = msg.value
                        pending.done.set()
                elif isinstance(msg, Conn) and len(fds) == 1:
                    self._start(msg, socket.socket(fileno=fds[0]), ssl_context)
                    fds = []
                else:
                    logger.error("store process: unexpected %s on the link", type(msg).__name__)
                for fd in fds:
                    socket.socket(fileno=fd).close()
        finally:
            self._close()

    def _start(self, conn: Conn, sock: socket.socket, ssl_context: ssl.SSLContext | None) -> None:
        raw = sock.dup()
        session = StoreThread(self, conn.cid, sock, raw, ssl_context, conn.peer)

        def body() -> None:
            try:
                session.run()
            finally:
                with self._lock:
                    self._sessions.pop(conn.cid, None)
                raw.close()
                try:
                    self._send(Ended(cid=conn.cid, reason=session.reason))
                except OSError:
                    pass  # the relay is gone: it ended the session itself

        thread = threading.Thread(target=body, name=f"store-{conn.cid}", daemon=True)
        with self._lock:
            self._sessions[conn.cid] = (thread, raw)
        thread.start()

    def _close(self) -> None:
        with self._lock:
            self._closed = True
            pending, self._pending = self._pending, {}
            sessions = list(self._sessions.values())
        for p in pending.values():
            p.error = "the relay is gone"
            p.done.set()
        for _, raw in sessions:
            try:
                raw.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + EXIT_WAIT
        for thread, _ in sessions:
            thread.join(max(0.0, deadline - time.monotonic()))


def _rejected(refusal: Refusal, job: int, rank: int) -> Refused:
    return Refused(refusal.code, refusal.message, job=job, rank=rank)


def _unexpected(request: type[Request], answer: Answer) -> LinkClosed:
    """The relay answered ``request`` with something else than its answers (a bug)."""
    return LinkClosed(f"the relay answered {request.__name__} with {type(answer).__name__}")


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    nice, fd = int(sys.argv[1]), int(sys.argv[2])
    lower_this_process(nice)
    sock = socket.socket(fileno=fd)
    data = sock.recv(MAX_PACKET)
    if not data:
        return
    try:
        init = to_worker.decode(data)
    except msgspec.DecodeError as exc:
        sys.exit(f"storeworker: bad Init ({exc})")
    if not isinstance(init, Init):
        sys.exit(f"storeworker: expected Init, got {type(init).__name__}")
    logging.basicConfig(
        level=init.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    ssl_context = None
    if init.tls_cert and init.tls_key:
        ssl_context = tls.server_context(Path(init.tls_cert), Path(init.tls_key))
    RelayLink(sock, init).serve(ssl_context)


if __name__ == "__main__":
    main()
