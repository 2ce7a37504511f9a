"""The relay's side of its store process (``storeworker``, over ``storelink``).

``StoreSupervisor.serve`` hands a store connection whose preamble was read to the store
process and waits for the session's ``Ended``; the process is started at the first such
connection (starting one costs 0.4 s of CPU, which a relay that stores nothing, like most in
the tests, never pays) and again at the next after it died. ``run`` (a task of the relay's)
owns the processes: it answers their ``Call``s from ``CheckpointStore``, each request by its
type (``_call``: one ``case`` per request of ``storelink``, each returning one of that
request's answers), and stops the process when the relay stops. A request the relay cannot
answer (its session is over, or answering it failed) gets ``NoAnswer``, which ends that
session; a packet that does not decode stops the process.

At most ``store_threads`` sessions run at once; more wait here, before their TLS handshake.
The relay keeps its own copy of each session's socket: when it stops, it shuts them down,
which ends every blocking call of the session's thread, and closes the link, which makes the
process end them all and exit (killed, by its pid, if it is not gone after ``STOP_WAIT``). A
session that ends with an upload under way (its process died, or the relay stops) releases its
rank's ``uploading`` entry here; its part file is deleted by its thread, or, if the process
died, here.
"""

from __future__ import annotations

import itertools
import logging
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, assert_never

import msgspec
import trio

from vpool.protocol.relay_core import Refused
from vpool.reasons import describe
from vpool.relay.ckptstore import PART, Image, Key, ckpt_dir
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
    fd_rights,
    from_worker,
)

if TYPE_CHECKING:
    from vpool.relay.ckptstore import CheckpointStore

logger = logging.getLogger(__name__)

COMMAND = [sys.executable, "-m", "vpool.relay.storeworker"]
# How long a stopping relay waits for its store process to end its sessions and exit.
STOP_WAIT = 15.0


class _Session:
    def __init__(self, cid: int) -> None:
        self.cid = cid
        self.ended = trio.Event()
        self.reason = ""
        self.upload: Key | None = None  # between a granted begin_put and its end

    def end(self, reason: str) -> None:
        if not self.ended.is_set():
            self.reason = reason
            self.ended.set()


class _Process:
    """One store process and its end of the link."""

    def __init__(self, proc: trio.Process, link: trio.socket.SocketType) -> None:
        self.proc = proc
        self.link = link
        self.send_lock = trio.Lock()
        self.sessions: dict[int, _Session] = {}
        self.gone = False

    async def send(self, msg: Reply | Conn | Init, fd: int | None = None) -> None:
        async with self.send_lock:
            ancdata = fd_rights(fd) if fd is not None else []
            await self.link.sendmsg([encode(msg)], ancdata)


class StoreSupervisor:
    """The store process of one relay (module docstring)."""

    def __init__(self, store: CheckpointStore) -> None:
        self.store = store
        self.hub = store.hub
        self.limiter = trio.CapacityLimiter(max(1, self.hub.settings.store_threads))
        self.current: _Process | None = None
        self._starting = trio.Lock()
        self._cids = itertools.count(1)
        self._nursery: trio.Nursery | None = None

    @property
    def pid(self) -> int | None:
        """The store process's pid, while one runs."""
        p = self.current
        return None if p is None or p.gone else p.proc.pid

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the store processes until cancelled (the relay stops)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    # -- connections ----------------------------------------------------------------------------

    async def serve(self, tcp: trio.SocketStream, peer: str) -> None:
        """Serve a store connection whose preamble was read, in the store process, until it
        ends. Cancelled (the relay stops), its socket is shut down and its end awaited."""
        async with self.limiter:
            try:
                p = await self._process()
            except OSError as exc:
                logger.error("cannot start the store process: %s", describe(exc))
                await trio.aclose_forcefully(tcp)
                return
            sock = socket.socket(fileno=tcp.socket.detach())
            session = _Session(next(self._cids))
            p.sessions[session.cid] = session
            try:
                await p.send(Conn(cid=session.cid, peer=peer), sock.fileno())
                await session.ended.wait()
            except OSError as exc:
                session.end(f"the store process is gone: {describe(exc)}")
            finally:
                if not session.ended.is_set():
                    _shutdown(sock)
                    with trio.CancelScope(shield=True), trio.move_on_after(STOP_WAIT):
                        await session.ended.wait()
                p.sessions.pop(session.cid, None)
                sock.close()
                if session.upload is not None:
                    self.store.uploading.discard(session.upload)
                    if p.gone:
                        await self._sweep_parts(session.upload)
            logger.debug("store session %d from %s ended: %s", session.cid, peer, session.reason)

    async def _process(self) -> _Process:
        async with self._starting:
            p = self.current
            if p is None or p.gone:
                p = await self._start()
                self.current = p
            return p

    async def _start(self) -> _Process:
        assert self._nursery is not None, "StoreSupervisor.run is not running"
        settings = self.hub.settings
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            proc = await trio.lowlevel.open_process(
                # It lowers its priority itself, once imported (``storeworker``). Same process
                # group and session as the relay: one scheduler autogroup with the ranks on a
                # machine that runs both (docs/internals.md, "Niceness").
                [*COMMAND, str(settings.store_nice), str(theirs.fileno())],
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        p = _Process(proc, trio.socket.from_stdlib_socket(ours))
        tls = bool(settings.tls_cert and settings.tls_key)
        init = Init(
            name=self.hub.name,
            data_dir=str(self.hub.data_dir),
            handshake_timeout=settings.handshake_timeout,
            store_idle_timeout=settings.store_idle_timeout,
            checkpoint_max_bytes=settings.checkpoint_max_bytes,
            store_report_wait=settings.store_report_wait,
            bulk=settings.store_bulk,
            tls_cert=settings.tls_cert if tls else "",
            tls_key=settings.tls_key if tls else "",
            log_level=logging.getLogger().getEffectiveLevel(),
        )
        try:
            await p.send(init)
        except OSError:
            p.gone = True
            proc.kill()
            raise
        self._nursery.start_soon(self._watch, p)
        logger.info("store process started (pid %d)", proc.pid)
        return p

    # -- the link -------------------------------------------------------------------------------

    async def _watch(self, p: _Process) -> None:
        """Answer the process's calls until its link ends; then make sure it is gone."""
        try:
            async with trio.open_nursery() as calls:
                while True:
                    data, _, flags, _ = await p.link.recvmsg(MAX_PACKET)
                    if not data:
                        break
                    if flags & socket.MSG_TRUNC:
                        logger.error("store process: a link packet was truncated; stopping it")
                        break
                    try:
                        msg = from_worker.decode(data)
                    except msgspec.DecodeError as exc:
                        logger.error(
                            "store process: bad link packet (%s); stopping it", describe(exc)
                        )
                        break
                    if isinstance(msg, Ended):
                        session = p.sessions.get(msg.cid)
                        if session is not None:
                            session.end(msg.reason)
                    else:
                        calls.start_soon(self._answer, p, msg)
                calls.cancel_scope.cancel()
        finally:
            p.gone = True
            with trio.CancelScope(shield=True):
                await self._stop(p)

    async def _stop(self, p: _Process) -> None:
        p.link.close()  # the process ends its sessions and exits
        with trio.move_on_after(STOP_WAIT):
            await p.proc.wait()
        if p.proc.returncode is None:
            logger.warning("store process %d did not exit; killing it", p.proc.pid)
            p.proc.kill()
            await p.proc.wait()
        elif p.proc.returncode != 0:
            logger.warning("store process %d exited with %d", p.proc.pid, p.proc.returncode)
        for session in list(p.sessions.values()):
            session.end("the store process ended")

    async def _answer(self, p: _Process, call: Call) -> None:
        session = p.sessions.get(call.cid)
        answer: Answer
        if session is None:
            answer = NoAnswer(error=f"store session {call.cid} is over")
        else:
            try:
                answer = await self._call(session, call.request)
            except Exception:
                # A bad call (or a bug) ends that session, never the relay.
                logger.exception("store process: call %r failed", call.request)
                answer = NoAnswer(error=f"the relay could not answer {type(call.request).__name__}")
        try:
            await p.send(Reply(rid=call.rid, value=answer))
        except OSError:
            pass  # the process is gone; _watch sees the end of the link

    async def _call(self, session: _Session, request: Request) -> Answer:
        store = self.store
        match request:
            case SigningKeyAsk():
                key = await store.signing_key()
                return SigningKey(raw=None if key is None else key.public_bytes_raw())
            case BeginPut(job=job, rank=rank, incarnation=incarnation, ckpt=ckpt):
                rej = store.begin_put((job, rank), incarnation, ckpt)
                if rej is not None:
                    return Refusal(code=rej.code, message=rej.message)
                session.upload = (job, rank)
                return Granted()
            case EndUpload(job=job, rank=rank):
                store.uploading.discard((job, rank))
                session.upload = None
                return Done()
            case JobFinished(job=job):
                return JobState(finished=job in self.hub.finished)
            case Commit(manifest=manifest, directory=directory, wait=wait):
                img = Image.from_json(manifest, Path(directory))
                # The image's directory is the one its rank's images go to, whatever is said.
                if img.directory != ckpt_dir(self.hub.data_dir, img.job, img.rank):
                    raise ValueError(f"image {img.ckpt} of rank {img.rank} is in {directory}")
                session.upload = None
                answer = await store.commit_put(img)
                if isinstance(answer, Refused):
                    return Refusal(code=answer.code, message=answer.message)
                return Committed(retained=answer, known=await store.report_outcome(img, wait))
            case ImageAsk(job=job, rank=rank, ckpt=ckpt):
                found = store.image((job, rank), ckpt)
                if found is None:
                    return NotFound()
                return Found(manifest=found.to_json(), directory=str(found.directory))
            case _:
                assert_never(request)

    async def _sweep_parts(self, key: Key) -> None:
        """The upload of ``key`` died with its process: delete its part file (the rank had
        no other upload here, ``busy``)."""
        directory = ckpt_dir(self.hub.data_dir, *key)

        def sweep() -> None:
            for part in directory.glob(f"*{PART}"):
                part.unlink(missing_ok=True)

        await trio.to_thread.run_sync(sweep, limiter=self.hub.io_limiter)


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
