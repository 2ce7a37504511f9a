"""Checkpoints of a rank: a forked clone the agent dumps, which can later be restored.

docs/internals.md, "Checkpoints". Enabled when the agent sets ``VPOOL_CKPT_SIGNAL``
(a signal number) and ``VPOOL_RANK_DIR`` (the rank directory); ``MPI.Init`` then calls
``start``, which opens the control connection (``RankHello(control=True)``) and installs the
signal handler.

Requests come as a ``CheckpointRequest`` frame on the data connection (the transport sets
``Transport.ckpt_request``; ``Engine.wait``/``block``/``poke`` call ``on_request`` after a read)
and as the signal, for a rank computing without MPI calls: the handler acts only when no frame
of the runtime (``vpool.mpi``, ``vpool.protocol``, the ``mpi4py`` shim) is on the
interrupted stack. While the rank replays (``FT.busy``) a request waits. While a thread marked
by ``observe.thread`` runs (``mpi4py.futures``' manager) it is refused at once: a clone keeps
only the forking thread, so it could not be restored.

``take`` at a safe point: the large payload being read is finished, pending determinant records
are written, stdio flushed, what of it still sits in the stdout/stderr pipes counted
(``FIONREAD``: the agent reads none of it until it has ``CkptForked``); then ``fork()``. The
parent reports ``CkptForked(ckpt, pid, counters, pending, pause)`` and returns: no round trip
to the agent, so its pause is the flushes and the fork. The clone leaves the agent's sockets
and stdio and waits while its parent lives; then it is either a restored process
(``$VPOOL_RANK_DIR/.vpool-restore.json`` names its checkpoint: it reconnects and resumes the
replay from its counters, ``FT.resume``) or an orphan: the rank died, and the agent may still
dump the clone, the freshest state there is, so it exits only after ``$VPOOL_CKPT_ORPHAN_WAIT``
seconds (the agent's ``lost_checkpoint_grace``; at once without it) if nobody does.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import struct
import sys
import termios
import threading
import time
from types import FrameType
from typing import Any

import msgspec

from vpool.mpi import observe
from vpool.mpi.hugepages import collapse_huge_pages
from vpool.mpi.transport import die, open_connection, write_message
from vpool.protocol.messages import PROTOCOL_VERSION, CkptForked, RankHello

SIGNAL_ENV = "VPOOL_CKPT_SIGNAL"
RANK_DIR_ENV = "VPOOL_RANK_DIR"
CLONE_TIMEOUT_ENV = "VPOOL_CKPT_CLONE_TIMEOUT"
CLONE_TIMEOUT = 600.0  # seconds a clone waits to be dumped and restored, or orphaned
RESTORE_FILE = ".vpool-restore.json"
CLONE_POLL = 0.01  # seconds between the clone's looks at its parent
ORPHAN_WAIT_ENV = "VPOOL_CKPT_ORPHAN_WAIT"  # s an orphaned clone still waits to be dumped
SIGNAL_READS = 256  # reads at most, looking for the request frame from the signal handler
# Modules whose frames on the interrupted stack mean "inside an MPI call": not a safe point.
_RUNTIME = ("vpool.mpi", "vpool.protocol", "mpi4py")


def _in_runtime(name: Any) -> bool:
    if not isinstance(name, str):
        return False
    return any(name == p or name.startswith(p + ".") for p in _RUNTIME)


def start(eng: Any, transport: Any, secret: str) -> Checkpointer | None:
    """Enable checkpoints if the agent asked for them (environment); None otherwise."""
    signum = os.environ.get(SIGNAL_ENV, "").strip()
    rank_dir = os.environ.get(RANK_DIR_ENV, "").strip()
    if not signum or not rank_dir:
        return None
    try:
        num = int(signum)
        timeout = float(os.environ.get(CLONE_TIMEOUT_ENV) or CLONE_TIMEOUT)
        orphan_wait = float(os.environ.get(ORPHAN_WAIT_ENV) or 0.0)
    except ValueError:
        die(f"{SIGNAL_ENV}={signum!r} / {CLONE_TIMEOUT_ENV} / {ORPHAN_WAIT_ENV}: expected numbers")
        raise
    path = os.environ.get("VPOOL_AGENT_SOCKET", "")
    ckpt = Checkpointer(eng, transport, path, secret, rank_dir, num, timeout, orphan_wait)
    # The handler first: once the control connection is up the agent may signal (an ordered
    # checkpoint waits for it), and the signal's default action ends the process.
    ckpt.install()
    ckpt.connect_control(-1)
    return ckpt


class Checkpointer:
    """The checkpoint side of one rank process (``Engine.ckpt``)."""

    def __init__(
        self,
        eng: Any,
        transport: Any,
        path: str,
        secret: str,
        rank_dir: str,
        signum: int,
        clone_timeout: float = CLONE_TIMEOUT,
        orphan_wait: float = 0.0,
    ) -> None:
        self.eng = eng
        self.transport = transport
        self.path = path
        self.secret = secret
        self.rank_dir = rank_dir
        self.signum = signum
        self.clone_timeout = clone_timeout
        self.orphan_wait = orphan_wait  # the agent's lost_checkpoint_grace; 0 without an agent
        self.control: socket.socket | None = None
        self.taken: list[int] = []  # checkpoints this process forked a clone for
        self.clones: list[int] = []  # pids of clones not reaped yet (CRIU ends them: zombies)
        self.restored = -1  # the checkpoint this process was restored from (-1: none)

    def connect_control(self, checkpoint: int) -> None:
        hello = RankHello(PROTOCOL_VERSION, self.secret, control=True, checkpoint=checkpoint)
        self.control, _ = open_connection(self.path, hello)

    def reap(self) -> None:
        """Collect the exit of every clone that ended (dumped or orphaned), without waiting."""
        alive = []
        for pid in self.clones:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue  # reaped already (by the program), or not our child (restored image)
            if not done:
                alive.append(pid)
        self.clones = alive

    def close(self) -> None:
        """The rank finalized: no more checkpoints."""
        self.reap()
        if self.control is not None:
            self.control.close()
            self.control = None

    def install(self) -> None:
        try:
            signal.signal(self.signum, self._on_signal)
            # Restart interrupted system calls: the handler runs between bytecodes anyway,
            # and a print() blocked on a full pipe is not re-entered from it.
            signal.siginterrupt(self.signum, False)
        except (ValueError, OSError):
            pass  # not the main thread: requests still come as frames

    # ---- requests ----------------------------------------------------------------------------

    def on_request(self) -> None:
        """Take the checkpoint the transport was asked for, unless replaying (later, then)."""
        t = self.transport
        request = t.ckpt_request
        if request is None or t.closed or self.control is None or self.eng.ft.busy():
            return
        t.ckpt_request = None
        why = observe.blocking_checkpoints()
        if why is not None:
            # A clone keeps only the forking thread: refuse at once (the agent says why)
            # rather than let the agent hold the rank's output until its wait runs out.
            write_message(self.control, CkptForked(request, -1, message=why))
            return
        if not self.take(request):
            t.ckpt_request = request  # not possible right now: a later call tries again

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if observe.blocking_checkpoints() is not None:
            # Another thread may be inside the runtime, reading the socket: the handler must
            # not read under it. That thread's MPI calls take the request (and refuse it).
            return
        f = frame
        while f is not None:
            if _in_runtime(f.f_globals.get("__name__")):
                return  # inside an MPI call: the request frame is acted on when it returns
            f = f.f_back
        t = self.transport
        if t.closed or self.control is None or self.eng.transport is not t or self.eng.ft.busy():
            return
        if t.ckpt_request is None:
            # The program computes: the request frame is waiting on the socket.
            for _ in range(SIGNAL_READS):
                if not t._read(socket.MSG_DONTWAIT) or t.ckpt_request is not None:
                    break
        if t.ckpt_request is not None:
            self.on_request()

    # ---- taking one --------------------------------------------------------------------------

    def take(self, request: int) -> bool:
        """Checkpoint ``request`` here (a safe point); False if it cannot be taken now. Returns
        in this process, in the clone once it is restored, never in an orphaned clone."""
        started, started_cpu = time.perf_counter(), time.thread_time()
        t = self.transport
        ft = self.eng.ft
        self.reap()
        while t.mid_payload:
            t._read(0)
        if ft.pending:
            ft.flush()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except RuntimeError:
                return False  # interrupted inside a write of that stream: not now
            except (OSError, ValueError, AttributeError):
                pass
        control = self.control
        assert control is not None
        pending = [_pipe_pending(1), _pipe_pending(2)]
        received, sent, dets = list(t.received), list(t.sent), t.det_sent
        stdin_at = _stdin_offset()  # before the fork: the clone shares the file offset
        parent = os.getpid()
        try:
            pid = os.fork()
        except OSError as exc:
            write_message(control, CkptForked(request, -1, message=f"fork failed: {exc}"))
            return True
        if pid:
            pause = int((time.perf_counter() - started) * 1e6)
            cpu = int((time.thread_time() - started_cpu) * 1e6)
            self.taken.append(request)
            self.clones.append(pid)
            forked = CkptForked(
                request, pid, received, sent, dets, pending, pause, pause_cpu_us=cpu
            )
            write_message(control, forked)
            threading.Thread(target=_after_clone, args=(pid,), daemon=True).start()
            return True
        forked = CkptForked(request, 0, received, sent, dets, pending)
        self._clone(request, parent, forked, stdin_at)
        return True

    def _clone(self, ckpt: int, parent: int, forked: CkptForked, stdin_at: int) -> None:
        """The forked clone: wait to be dumped, then restored (return) or orphaned (exit)."""
        try:
            # A process group of its own (the signals for the rank's group must not end the
            # checkpoint), in the rank's session: CRIU dumps and restores it with --shell-job,
            # so the restored rank too shares its agent's scheduler group (docs/internals.md).
            # CRIU refuses a session whose leader is outside the PID namespace (sid 0 there),
            # which is where a restored rank's session is: its clone leads one of its own.
            if os.getsid(0) == 0:
                os.setsid()
            else:
                os.setpgid(0, 0)
            self.clones = []
            t = self.transport
            for sock in (t.sock, self.control):
                # The fds only: no shutdown (that would end the parent's connection too), and
                # detached so a later close of the socket object cannot hit a reused fd.
                if sock is not None:
                    os.close(sock.detach())
            self.control = None
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.close(null)
            # The agent commits the image only once all of these are acknowledged.
            t.acked = list(t.sent)
            t.det_acked = t.det_sent
            deadline = time.monotonic() + self.clone_timeout
            orphaned = False
            while True:
                if os.getppid() != parent:
                    info = self._restore_info(ckpt)
                    if info is not None:
                        self._restore(ckpt, info, stdin_at)
                        return
                    if not orphaned:
                        # The rank died before this clone was dumped. The agent may still
                        # dump it (the rank's freshest state, for its replacement) or kill
                        # it; if neither comes, it exits by itself.
                        orphaned = True
                        deadline = min(deadline, time.monotonic() + self.orphan_wait)
                        if self.orphan_wait > 0:
                            self._report_orphan(forked)
                if time.monotonic() > deadline:
                    os._exit(0)
                time.sleep(CLONE_POLL)
        except BaseException:
            os._exit(1)  # never back into the program as a half-restored process

    def _report_orphan(self, forked: CkptForked) -> None:
        """Say ``CkptForked`` to the agent in the dead rank's place: it may have died between
        the fork and its own report. Closed before the agent dumps this process (CRIU would
        not take a socket to the agent); a duplicate of the rank's own report is ignored."""
        hello = RankHello(PROTOCOL_VERSION, self.secret, orphan=True)
        try:
            # An agent that is gone or refuses (it no longer knows the rank) ends this
            # process here (``die``): nobody would dump it.
            sock, _ = open_connection(self.path, hello)
        except OSError:
            return
        try:
            write_message(sock, msgspec.structs.replace(forked, pid=os.getpid(), orphan=True))
        except OSError:
            pass
        finally:
            sock.close()

    def _restore_info(self, ckpt: int) -> dict[str, Any] | None:
        try:
            with open(os.path.join(self.rank_dir, RESTORE_FILE), encoding="utf-8") as f:
                info = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(info, dict) or info.get("checkpoint") != ckpt:
            return None
        try:
            # It holds the new incarnation's secret: read once, then gone.
            os.unlink(os.path.join(self.rank_dir, RESTORE_FILE))
        except OSError:
            pass
        return info

    def _restore(self, ckpt: int, info: dict[str, Any], stdin_at: int) -> None:
        """A restored process: output to the agent's FIFOs, its stdin file where it was at
        the fork (what the program had read ahead is in its buffers, restored with it), new
        connections, resume replay."""
        for fd, key in ((1, "stdout"), (2, "stderr")):
            w = os.open(str(info[key]), os.O_WRONLY)
            if w != fd:
                os.dup2(w, fd)
                os.close(w)
        stdin = info.get("stdin")
        if stdin and stdin_at >= 0:
            r = os.open(str(stdin), os.O_RDONLY)
            os.lseek(r, stdin_at, os.SEEK_SET)
            if r != 0:
                os.dup2(r, 0)
                os.close(r)
        self.path = str(info["socket"])
        self.secret = str(info["secret"])
        t = self.transport
        hello = RankHello(PROTOCOL_VERSION, self.secret, checkpoint=ckpt)
        sock, welcome = open_connection(self.path, hello)
        if (welcome.job, welcome.rank, welcome.size) != (t.job, t.rank, t.size):
            die(
                f"restored as rank {welcome.rank} of {welcome.size} (job {welcome.job}); "
                f"the image is rank {t.rank} of {t.size} (job {t.job})"
            )
        t.reopen(sock, welcome)
        self.connect_control(ckpt)
        os.environ.update(VPOOL_AGENT_SOCKET=self.path, VPOOL_INCARNATION=str(welcome.incarnation))
        self.restored = ckpt
        self.eng.ft.resume(t, welcome.replay_dets, welcome.replay_sent)


def _stdin_offset() -> int:
    """Where fd 0 stands in its file (-1: not a file, a pipe or a terminal)."""
    try:
        return os.lseek(0, 0, os.SEEK_CUR)
    except OSError:
        return -1


def _after_clone(pid: int) -> None:
    """Watcher thread of one clone: reap it when it ends (dumped and killed, or orphaned), then
    put the rank's big arrays back on huge pages.

    While the clone lives, every page the rank writes is copied (copy-on-write), and the kernel
    splits a huge page into 4 KiB ones to do so. The next ``fork()`` would then copy 51,200
    page-table entries per 200 MB instead of 100 (6 ms against 1 ms here), which is most of
    the pause. The collapse runs here, in the background, GIL released."""
    try:
        os.waitpid(pid, 0)
    except (ChildProcessError, InterruptedError):
        pass  # reaped by the program or by ``reap``: it ended all the same
    collapse_huge_pages()


def _pipe_pending(fd: int) -> int:
    """Bytes written to ``fd`` that its reader has not taken yet (0 unless it is a pipe or a
    socket that says)."""
    buf = bytearray(4)
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf)
    except OSError:
        return 0
    return int(struct.unpack("i", buf)[0])
