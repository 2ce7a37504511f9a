"""The checkpoint bench over the router of ``vsdk mpiexec`` (``--ckpt``, see ``replay``).

The replaying router's part that requests a checkpoint of one rank (``CheckpointRequest`` + the
signal, the rank's output held meanwhile), takes ``CkptForked`` on the rank's control connection,
commits once every frame the rank counts as sent is in, and later kills the rank so that its
forked clone restores from ``.vpool-restore.json`` (or, ``orphan``, exits by itself).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import signal
import termios
from typing import TYPE_CHECKING

import trio

from vpool.protocol.errors import RemoteProtocolError
from vpool.protocol.messages import CheckpointRequest, CkptForked
from vpool.sdk.mpiexec_router import _Router
from vpool.sdk.mpiexec_wire import _GONE, SocketFrames, _acquire, _frame, _write

if TYPE_CHECKING:
    from tests.mpi.bench.replay_router import _RRank

CKPT_SIGNAL = signal.SIGRTMIN + 4
CKPT_ID = 1
SIGNAL_EVERY = 0.05  # seconds between checkpoint signals until CkptForked, at most SIGNALS times
SIGNALS = 100
ORPHAN_GRACE = 10.0  # seconds an orphaned clone may take to notice and exit


class CheckpointBench(_Router):
    """The checkpoint bench's half of ``ReplayRouter`` (which sets the state below)."""

    kill: tuple[int, int] | None
    ckpt: tuple[int, int, int, bool] | None
    sock_path: str
    pending_secrets: dict[str, _RRank]  # restore secrets, before adoption
    clones: list[int]
    orphans: list[trio.Event]  # set once each orphaned clone is gone

    def _ckpt_step(self, rank: _RRank) -> None:
        assert self.ckpt is not None and self.nursery is not None
        _, n, m, _ = self.ckpt
        first = 2 if self.kill is not None and self.kill[0] == rank.index else 1
        if rank.ckpt_state == "" and rank.incarnation == first and rank.deposits == n:
            rank.ckpt_state = "requested"
            self.nursery.start_soon(self._request, rank)
        elif rank.ckpt_state == "committed" and rank.deposits >= rank.commit_deposits + m:
            self._kill_for_restore(rank)

    async def _request(self, rank: _RRank) -> None:
        """CheckpointRequest on the data connection, and the signal until CkptForked; the
        output held meanwhile (released here if the rank never forks)."""
        sock = rank.sock
        rank.hold = trio.Event()
        rank.held_at = list(rank.copied)
        try:
            await _acquire(rank.lock)
            try:
                await _write(sock, _frame(CheckpointRequest(CKPT_ID)))
            except _GONE:
                return
            finally:
                rank.lock.release()
            proc = rank.proc
            for _ in range(SIGNALS):
                if rank.ready_event.is_set() or proc is None or proc.returncode is not None:
                    return
                if rank.finalized:
                    return
                proc.send_signal(CKPT_SIGNAL)
                with trio.move_on_after(SIGNAL_EVERY):
                    await rank.ready_event.wait()
        finally:
            if not rank.ready_event.is_set():
                hold, rank.hold = rank.hold, None
                if hold is not None:
                    hold.set()

    async def _serve_control(self, rank: _RRank, frames: SocketFrames) -> None:
        """The checkpoint control connection: CkptForked -> the image's offsets, commit."""
        while True:
            try:
                msg = await frames.message()
            except _GONE:
                return
            if msg is None:
                return
            if isinstance(msg, CkptForked) and rank.ckpt_state == "requested":
                rank.ckpt_ready = msg
                pending = [*msg.pending, 0, 0]
                rank.offsets = [rank.held_at[i] + pending[i] for i in (0, 1)]
                hold, rank.hold = rank.hold, None
                if hold is not None:
                    hold.set()
                rank.ckpt_state = "forked"
                rank.ready_event.set()
                record = {
                    "incarnation": rank.incarnation,
                    "received": msg.received,
                    "sent": msg.sent,
                    "dets": msg.dets,
                    "welcome_dets": rank.welcomed[0],
                    "welcome_sent": rank.welcomed[1],
                    "offsets": rank.offsets,
                    "pause_us": msg.pause_us,
                }
                self.say(f"checkpoint {CKPT_ID} of rank {rank.index}: {json.dumps(record)}")
                if msg.pid <= 0:
                    self.fail(1, f"rank {rank.index} could not fork: {msg.message}")
                    return
                rank.clone_pid = msg.pid
                self.clones.append(msg.pid)
                self.say(f"checkpoint {CKPT_ID} of rank {rank.index}: clone {msg.pid}")
                assert self.nursery is not None
                self.nursery.start_soon(self._commit, rank)
            else:
                raise RemoteProtocolError(f"unexpected {type(msg).__name__} on the control line")

    async def _commit(self, rank: _RRank) -> None:
        """Commit once every frame the rank sent before it forked is in (acknowledged)."""
        ready = rank.ckpt_ready
        assert ready is not None and self.ckpt is not None
        while not (
            len(rank.dets) >= ready.dets
            and all(len(rank.sent.get(d, ())) >= seq for d, seq in enumerate(ready.sent))
        ):
            await rank.progress.wait()
        rank.ckpt_state = "committed"
        rank.commit_deposits = rank.deposits
        if self.ckpt[2] == 0:
            self._kill_for_restore(rank)

    def _kill_for_restore(self, rank: _RRank) -> None:
        """Kill the rank; its clone restores (restore file first: it looks once reparented)."""
        assert self.ckpt is not None
        proc = rank.proc
        if proc is None or proc.returncode is not None or rank.finalized:
            return
        rank.ckpt_state = "done"
        if not self.ckpt[3]:
            secret = secrets.token_hex(16)
            paths = [os.path.join(rank.rank_dir, f"std{s}-{CKPT_ID}") for s in ("out", "err")]
            fds = []
            for path in paths:
                os.mkfifo(path, 0o600)
                fds.append(os.open(path, os.O_RDONLY | os.O_NONBLOCK))
                # A write end of our own until the clone has opened its: a FIFO without a
                # writer reads as the end of the file.
                rank.fifo_writers.append(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            info = {
                "checkpoint": CKPT_ID,
                "socket": self.sock_path,
                "secret": secret,
                "incarnation": rank.incarnation + 1,
                "stdout": paths[0],
                "stderr": paths[1],
            }
            final = os.path.join(rank.rank_dir, ".vpool-restore.json")
            with open(final + ".tmp", "w", encoding="utf-8") as f:
                json.dump(info, f)
            os.replace(final + ".tmp", final)
            rank.adopt = (secret, fds[0], fds[1])
            self.pending_secrets[secret] = rank
        else:
            self.orphans.append(trio.Event())
            assert self.nursery is not None
            self.nursery.start_soon(self._watch_orphan, rank, self.orphans[-1])
        rank.restarting = True
        proc.kill()

    async def _watch_orphan(self, rank: _RRank, done: trio.Event) -> None:
        """An orphaned clone (no restore file) must end by itself, soon."""
        try:
            pidfd = os.pidfd_open(rank.clone_pid)
        except OSError:
            pidfd = -1  # gone already
        try:
            if pidfd >= 0:
                with trio.move_on_after(ORPHAN_GRACE) as scope:
                    await trio.lowlevel.wait_readable(pidfd)
                if scope.cancelled_caught:
                    self.fail(1, f"orphaned clone {rank.clone_pid} of rank {rank.index} lives on")
                    return
            self.say(f"orphaned clone {rank.clone_pid} of rank {rank.index} exited")
        finally:
            if pidfd >= 0:
                os.close(pidfd)
            done.set()

    def kill_clones(self) -> None:
        """Kill clones still alive (each leads its own process group: a reused pid seldom)."""
        for pid in self.clones:
            try:
                if os.getpgid(pid) == pid:
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def _close_writers(rank: _RRank) -> None:
    for fd in rank.fifo_writers:
        os.close(fd)
    rank.fifo_writers.clear()


def _pending(fd: int) -> int:
    """Bytes waiting in a pipe."""
    if fd < 0:
        return 0
    buf = bytearray(4)
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf)
    except OSError:
        return 0
    return int.from_bytes(buf, "little")
