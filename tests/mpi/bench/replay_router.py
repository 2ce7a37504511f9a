"""The router of the replay bench that restarts a killed rank with replay (see ``replay`` for
the bench's options); it extends the router of ``vsdk mpiexec`` (``vpool.sdk.mpiexec_router``).

It keeps every frame (the relays' logs): ``Data`` delivered to each rank, in delivery order, and
what each rank sent, by channel and seq, so a new incarnation gets its determinants, every
message delivered so far again and ``replay_sent``; re-sent messages are compared byte for byte
with the ones already delivered. It runs each rank's incarnations in turn and shows their output
through pipes, each byte once over all incarnations. The checkpoint bench's half is
``ckpt.CheckpointBench``.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
from typing import Any

import trio

from tests.mpi.bench.ckpt import CKPT_ID, CKPT_SIGNAL, CheckpointBench, _close_writers
from vpool.protocol.errors import ErrorCode, RemoteProtocolError, divergence_message
from vpool.protocol.framing import Large, Small, decode_head
from vpool.protocol.messages import (
    Ack,
    CkptForked,
    Data,
    Det,
    DetAck,
    Error,
    Message,
    RankWelcome,
)
from vpool.sdk.mpiexec import rank_environment
from vpool.sdk.mpiexec_router import (
    JOB,
    KILL_GRACE,
    _Rank,
    hello_refusal,
    read_hello,
)
from vpool.sdk.mpiexec_wire import (
    _GONE,
    SocketFrames,
    _acquire,
    _frame,
    _write,
)


class _RRank(_Rank):
    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.dets: list[bytes] = []  # its determinants (Det.data by index), acked at once
        self.incarnation = 1
        self.log: list[bytes] = []  # Data frames delivered to this rank, in delivery order
        self.grew = trio.Event()
        self.sent: dict[int, list[bytes]] = {}  # destination -> frames from this rank, by seq
        self.deposits = 0  # Data frames deposited by the current incarnation
        self.restarting = False
        self.shown = [0, 0]  # bytes of stdout/stderr already shown (over all incarnations)
        self.log_keys: list[tuple[int, int]] = []  # (src, seq) of each frame of ``log``
        self.progress = trio.Event()  # set (and replaced) on every deposit and determinant
        # Checkpoint bench: "" -> requested -> forked -> committed -> done.
        self.ckpt_state = ""
        self.ckpt_ready: CkptForked | None = None
        self.ready_event = trio.Event()
        # While a checkpoint is requested the rank's output is not read (``_copy`` waits on
        # this), so the image's offsets are what was read then plus what the rank finds
        # still in its pipes when it forks.
        self.hold: trio.Event | None = None
        self.held_at = [0, 0]
        self.commit_deposits = 0
        self.clone_pid = 0
        self.rank_dir = ""
        self.copied = [0, 0]  # bytes read from the current incarnation's stdout/stderr
        self.out_fds = (-1, -1)  # read ends of those
        self.offsets = [0, 0]  # output offsets of the image (at the fork)
        self.adopt: tuple[str, int, int] | None = None  # (secret, stdout fd, stderr fd)
        self.adopted = trio.Event()
        self.fifo_writers: list[int] = []
        self.resume: CkptForked | None = None  # the incarnation resumes from this image
        self.welcomed = (0, {})  # (replay_dets, replay_sent) of the current incarnation


class ReplayRouter(CheckpointBench):
    def __init__(
        self,
        size: int,
        err: Any,
        kill: tuple[int, int] | None,
        command: list[str],
        env: Any,
        ckpt: tuple[int, int, int, bool] | None = None,
    ) -> None:
        super().__init__(size, err)
        self.ranks = [_RRank(i) for i in range(size)]
        self.by_secret = {r.secret: r for r in self.ranks}
        self.kill = kill
        self.ckpt = ckpt
        self.command = command
        self.env = env
        self.sock_path = ""
        self.out_fds = (1, 2)
        self.restarts = 0
        self.pending_secrets: dict[str, _RRank] = {}  # restore secrets, before adoption
        self.clones: list[int] = []
        self.orphans: list[trio.Event] = []  # set once each orphaned clone is gone

    def fail(self, code: int, reason: str) -> None:
        super().fail(code, reason)
        self.kill_clones()  # a restored rank is a clone, not the process the base kills

    # ---- processes -------------------------------------------------------------------------

    async def run_rank(self, rank: _RRank) -> None:
        """Run the rank's incarnations until one ends without being killed by the router."""
        while True:
            code: int | None = None
            adopt = rank.adopt
            if adopt is not None:
                # The clone of the checkpoint, reparented by the kill: not our child, so its
                # end is seen through a pidfd and its fate through its connection.
                rank.adopt = None
                fds = (adopt[1], adopt[2])
                starts = list(rank.offsets)
                pidfd = os.pidfd_open(rank.clone_pid)
                proc = None
            else:
                env = rank_environment(self.env, rank.index, self.size, self.sock_path, rank.secret)
                env["VPOOL_INCARNATION"] = str(rank.incarnation)
                if rank.rank_dir:
                    env["VPOOL_CKPT_SIGNAL"] = str(int(CKPT_SIGNAL))
                    env["VPOOL_RANK_DIR"] = rank.rank_dir
                r_out, w_out = os.pipe()
                r_err, w_err = os.pipe()
                try:
                    proc = await trio.lowlevel.open_process(
                        self.command,
                        stdin=subprocess.DEVNULL,
                        stdout=w_out,
                        stderr=w_err,
                        env=env,
                    )
                finally:
                    os.close(w_out)
                    os.close(w_err)
                rank.proc = proc
                fds, starts = (r_out, r_err), [0, 0]
            rank.out_fds = fds
            rank.copied = starts
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._copy, rank, fds[0], 0)
                nursery.start_soon(self._copy, rank, fds[1], 1)
                if proc is not None:
                    code = await proc.wait()
                else:
                    try:
                        await trio.lowlevel.wait_readable(pidfd)
                    finally:
                        os.close(pidfd)
            if rank.sock is not None:
                with trio.move_on_after(KILL_GRACE):
                    await rank.hung_up.wait()
            if code is None:
                code = 0 if rank.finalized else 1
            if rank.restarting and self.exit_code is None:
                self._new_incarnation(rank)
                continue
            break
        rank.exited = True
        rank.ready.set()
        self.exited(rank, code)

    def _new_incarnation(self, rank: _RRank) -> None:
        del self.by_secret[rank.secret]
        restore = rank.adopt
        rank.secret = restore[0] if restore is not None else secrets.token_hex(16)
        self.by_secret[rank.secret] = rank
        rank.incarnation += 1
        rank.restarting = False
        rank.deposits = 0
        rank.sock = None
        rank.open = False
        rank.hung_up = trio.Event()
        rank.finalized = False
        self.restarts += 1
        if restore is not None:
            rank.resume = rank.ckpt_ready
            self.pending_secrets.pop(rank.secret, None)
            rank.adopted.set()
            self.say(
                f"restoring rank {rank.index} (incarnation {rank.incarnation}) "
                f"from checkpoint {CKPT_ID}"
            )
        else:
            rank.resume = None
            self.say(f"restarting rank {rank.index} (incarnation {rank.incarnation}) with replay")

    async def _copy(self, rank: _RRank, fd: int, stream: int) -> None:
        """Show what this incarnation writes beyond what earlier ones already showed (a
        restored one starts at the image's offset)."""
        out = self.out_fds[stream]
        os.set_blocking(fd, False)
        try:
            while True:
                if rank.hold is not None:
                    await rank.hold.wait()
                    continue
                try:
                    data = os.read(fd, 65536)
                except BlockingIOError:
                    await trio.lowlevel.wait_readable(fd)
                    continue
                if not data:
                    return
                start = rank.copied[stream]
                offset = rank.copied[stream] = start + len(data)
                if offset > rank.shown[stream]:
                    new = data[max(0, rank.shown[stream] - start) :]
                    rank.shown[stream] = offset
                    try:
                        os.write(out, new)
                    except OSError:
                        pass
        finally:
            trio.lowlevel.notify_closing(fd)
            os.close(fd)

    # ---- connections -------------------------------------------------------------------------

    async def _hello(self, frames: SocketFrames) -> _Rank | None:
        sock = frames.sock
        msg = await read_hello(frames)
        if msg is None:
            return None
        waiting = self.pending_secrets.get(msg.secret)
        if waiting is not None:
            # A restored clone can call before its predecessor is gone: it waits for that.
            with trio.move_on_after(30):
                await waiting.adopted.wait()
        rank = self.by_secret.get(msg.secret)
        assert rank is None or isinstance(rank, _RRank)
        refusal = hello_refusal(msg, known=rank is not None, connected=False)
        if refusal is None and msg.control:
            assert rank is not None
            await _write(sock, _frame(self._plain_welcome(rank)))
            await self._serve_control(rank, frames)
            return None
        if refusal is None:
            assert rank is not None
            refusal = hello_refusal(msg, known=True, connected=rank.sock is not None)
        if refusal is None and (msg.checkpoint >= 0) != (
            rank is not None and rank.resume is not None
        ):
            refusal = Error(
                ErrorCode.WRONG_CHECKPOINT, f"checkpoint {msg.checkpoint} is not this rank's"
            )
        if refusal is not None:
            await _write(sock, _frame(refusal))
            return None
        await _write(sock, self._welcome(rank))
        if msg.checkpoint >= 0:
            self.say(f"restored rank {rank.index} from checkpoint {msg.checkpoint}")
            _close_writers(rank)  # the clone opened its output FIFOs before it called
        rank.sock, rank.open = sock, True
        rank.ready.set()
        self._connected(rank, sock)
        return rank

    def _plain_welcome(self, rank: _RRank) -> RankWelcome:
        return RankWelcome(JOB, rank.index, self.size, rank.incarnation, socket.gethostname())

    def _welcome(self, rank: _Rank) -> bytes:
        assert isinstance(rank, _RRank)
        first = rank.resume.dets if rank.resume is not None else 0
        replay_sent = {d: len(frames) for d, frames in rank.sent.items() if frames}
        rank.welcomed = (len(rank.dets), replay_sent)
        welcome = RankWelcome(
            JOB,
            rank.index,
            self.size,
            rank.incarnation,
            socket.gethostname(),
            replay_dets=len(rank.dets),
            replay_sent=replay_sent,
        )
        return _frame(welcome) + b"".join(
            _frame(Det(JOB, rank.index, i, rank.dets[i])) for i in range(first, len(rank.dets))
        )

    def _connected(self, rank: _Rank, sock: socket.socket) -> None:
        assert isinstance(rank, _RRank) and self.nursery is not None
        self.nursery.start_soon(self._deliver, rank, sock)

    async def _deliver(self, rank: _RRank, sock: socket.socket) -> None:
        """Push the rank's log to this connection, from the start (a new incarnation replays)
        or, for a restored one, past what its image had received."""
        pos = 0
        skip = rank.resume.received if rank.resume is not None else None
        while rank.sock is sock:
            if pos < len(rank.log):
                end = len(rank.log)
                frames = rank.log[pos:end]
                if skip is not None:
                    keys = rank.log_keys[pos:end]
                    frames = [f for f, (s, q) in zip(frames, keys, strict=True) if q > skip[s]]
                pos = end
                await _acquire(rank.lock)
                try:
                    await _write(sock, b"".join(frames))
                except _GONE:
                    return
                finally:
                    rank.lock.release()
                continue
            await rank.grew.wait()

    async def _pump(self, rank: _Rank, frames: SocketFrames) -> None:
        assert isinstance(rank, _RRank)
        sock = frames.sock
        scanner = frames.scanner
        while (event := await frames.next_event()) is not None:
            if type(event) is Large:  # kept whole: this router keeps every frame
                msg = decode_head(event.head, event.header_len, event.payload_len)
                scanner.claim(bytearray(event.head.nbytes + event.payload_len), whole=True)
                continue
            if type(event) is Small:
                msg = decode_head(event.frame, event.header_len, event.payload_len)
                frame = bytes(event.frame)
            else:
                frame = bytes(event.target)
            await self._handle(rank, sock, msg, frame, event.payload_len)

    async def _handle(
        self, rank: _RRank, sock: socket.socket, msg: Message, frame: bytes, plen: int
    ) -> None:
        if type(msg) is Data:
            self._check(rank, msg)
            await self._deposit(rank, sock, msg, frame)
        elif plen:
            raise RemoteProtocolError(f"{type(msg).__name__} frame with a payload")
        elif type(msg) is Det:
            await _log_det(rank, sock, msg)
            _notify(rank)
        else:
            self._control(rank, msg)

    async def _deposit(self, rank: _RRank, sock: socket.socket, msg: Data, frame: bytes) -> None:
        chan = rank.sent.setdefault(msg.dst, [])
        if msg.seq <= len(chan):
            if chan[msg.seq - 1] != frame:
                self.fail(1, divergence_message(rank.index, msg.dst, msg.seq))
                return
        elif msg.seq == len(chan) + 1:
            chan.append(frame)
            target = self.ranks[msg.dst]
            assert isinstance(target, _RRank)
            target.log.append(frame)
            target.log_keys.append((msg.src, msg.seq))
            target.grew.set()
            target.grew = trio.Event()
        else:
            raise RemoteProtocolError(f"message {msg.seq} after {len(chan)} on a channel")
        await _acquire(rank.lock)
        try:
            await _write(sock, _frame(Ack(JOB, rank.index, msg.dst, msg.seq)))
        except _GONE:
            pass
        finally:
            rank.lock.release()
        rank.deposits += 1
        _notify(rank)
        kill = self.kill
        if (
            kill is not None
            and kill[0] == rank.index
            and rank.incarnation == 1
            and rank.deposits == kill[1]
            and rank.proc is not None
            and rank.proc.returncode is None
        ):
            rank.restarting = True
            rank.proc.kill()
        if self.ckpt is not None and self.ckpt[0] == rank.index:
            self._ckpt_step(rank)


async def _log_det(rank: _Rank, sock: socket.socket, msg: Det) -> None:
    """Log a determinant in the bench's own log and ack it at once."""
    if msg.job != JOB or msg.rank != rank.index:
        raise RemoteProtocolError(f"rank {rank.index} sent a determinant as {msg.rank}")
    if msg.index == len(rank.dets):
        rank.dets.append(msg.data)
    elif msg.index > len(rank.dets):
        raise RemoteProtocolError(f"determinant {msg.index} after {len(rank.dets) - 1}")
    await _acquire(rank.lock)
    try:
        await _write(sock, _frame(DetAck(JOB, rank.index, len(rank.dets))))
    except _GONE:
        pass
    finally:
        rank.lock.release()


def _notify(rank: _RRank) -> None:
    rank.progress.set()
    rank.progress = trio.Event()
