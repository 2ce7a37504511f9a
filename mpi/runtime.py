"""The point-to-point engine of a rank: sends, posted receives, progress.

Sits between the communicators (which translate ranks and contexts) and the transport (bytes
on the socket). Messages to the rank itself never touch the socket: they are copied and matched
locally, since no channel (s, s) exists on the relays.

Progress happens only inside MPI calls: ``wait`` blocks in the transport until the operation it
waits for completes; ``poke`` reads whatever has arrived without blocking. There are no pending
writes between calls (sends complete when handed to the socket), so at every call boundary the
process state is plain data: the queues of the matcher and the transport's counters.

Synchronous sends (``Ssend``/``Issend``) carry ``KIND_SYNC`` in ``Data.kind``; the receiver, when
it matches such a message, answers with an empty ``Data`` on the reserved context ``CTX_MATCHED``
whose tag is the matched message's seq. The send completes when that notice arrives. Notices are
queued while the transport is delivering (no writes from inside its callbacks) and sent when the
MPI call that made progress returns control to the engine.
"""

from __future__ import annotations

from typing import Any

from vpool.mpi import errors
from vpool.mpi.constants import ANY_SOURCE
from vpool.mpi.matching import Matcher
from vpool.mpi.transport import Transport, die
from vpool.protocol.messages import KIND_BUFFER, Data
from vpool.protocol.rank_ft import BATCH, FT

KIND_SYNC = 0x10  # flag on Data.kind: the sender waits until the message is matched
CTX_MATCHED = -1  # reserved context of "your synchronous message seq=tag was matched" notices


class SyncSendOp:
    """A synchronous send: done once the receiver matched it."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False

    def finish(self, status: Any) -> None:
        if status is not None:
            status._fill(-2, -1, 0)  # ANY_SOURCE, ANY_TAG: a send's status says nothing
        return None


class Engine:
    __slots__ = (
        "advancing",
        "ckpt",
        "early",
        "ft",
        "job",
        "local_seq",
        "matcher",
        "next_ctx",
        "notices",
        "rank",
        "schedules",
        "size",
        "syncs",
        "transport",
    )

    def __init__(self, job: int, rank: int, size: int) -> None:
        self.job = job
        self.rank = rank
        self.size = size
        self.matcher = Matcher()
        self.transport: Transport | None = None
        # Context ids: 0/1 are COMM_WORLD's, 2/3 COMM_SELF's (never on the wire); every new
        # communicator takes the next free even id, agreed by its members (``comm.agree_ctx``).
        self.next_ctx = 4
        # Synchronous sends waiting for their notice, by (destination world rank, seq).
        self.syncs: dict[tuple[int, int], SyncSendOp] = {}
        self.notices: list[tuple[int, int]] = []  # (source, seq) of matched synchronous messages
        self.early: set[tuple[int, int]] = set()  # notices that came before their send
        self.local_seq = 0  # seq numbers of messages to self (they never reach the transport)
        # Open non-blocking collectives (``sched.Schedule``): every blocking wait advances them,
        # so a rank blocked in, say, Recv still sends the rounds its peers' collectives need.
        self.schedules: list[Any] = []
        self.advancing = False
        # Determinants: logging live, obeying them on replay; a disagreement ends the rank.
        self.ft = FT(self, fail=die)
        self.ckpt: Any = None  # ``checkpoint.Checkpointer`` when checkpoints are enabled

    # ---- sending -------------------------------------------------------------------------

    def send(
        self, dst: int, ctx: int, tag: int, kind: int, parts: list[int], bufs: list[Any], n: int
    ) -> None:
        """Send one message to world rank ``dst``; eager: returns once it is on its way."""
        if dst == self.rank:
            self._send_local(ctx, tag, kind, parts, bufs)
        elif self.transport is not None:
            self.transport.send_data(dst, ctx, tag, kind, parts, bufs, n)
        else:
            raise errors.MPIException(errors.ERR_OTHER, "MPI is not initialized or finalized")

    def ssend(
        self, dst: int, ctx: int, tag: int, kind: int, parts: list[int], bufs: list[Any], n: int
    ) -> SyncSendOp:
        """Start a synchronous send; the returned operation is done once the message matched."""
        op = SyncSendOp()
        kind |= KIND_SYNC
        if dst == self.rank:
            self.local_seq += 1
            self.syncs[(dst, self.local_seq)] = op
            self._send_local(ctx, tag, kind, parts, bufs, self.local_seq)
        elif self.transport is not None:
            self.transport.send_data(dst, ctx, tag, kind, parts, bufs, n)
            key = (dst, self.transport.sent[dst])
            if key in self.early:
                self.early.discard(key)
                op.done = True
            else:
                self.syncs[key] = op
        else:
            raise errors.MPIException(errors.ERR_OTHER, "MPI is not initialized or finalized")
        return op

    def _send_local(
        self, ctx: int, tag: int, kind: int, parts: list[int], bufs: list[Any], seq: int = 0
    ) -> None:
        # Copy now: the sender may reuse its buffers as soon as the send returns.
        payload = bytearray().join(bufs) if parts else b"".join(bufs)
        msg = Data(self.job, self.rank, self.rank, seq, ctx, tag, kind, parts)
        op = self.matcher.arrive(msg)
        if op is not None:
            if op.src == ANY_SOURCE:
                self.ft.matched(op, msg.src)
            self._matched(msg)
            op.complete(msg, payload)
        else:
            self.matcher.stash(msg, payload)

    # ---- synchronous-send notices ----------------------------------------------------------

    def _matched(self, msg: Data) -> None:
        """A receive took ``msg``: tell its sender if it waits for that."""
        if msg.kind & KIND_SYNC:
            if msg.src == self.rank:
                op = self.syncs.pop((msg.src, msg.seq), None)
                if op is not None:
                    op.done = True
            else:
                self.notices.append((msg.src, msg.seq))

    def _flush_notices(self) -> None:
        # Asynchronous sends: logged, or on replay made where the log says (``ft``).
        self.ft.send_notices()

    def _send_notice(self, src: int, seq: int) -> None:
        if self.transport is not None:
            self.transport.send_data(src, CTX_MATCHED, seq, KIND_BUFFER, [], [], 0)

    def _on_notice(self, msg: Data) -> None:
        op = self.syncs.pop((msg.src, msg.tag), None)
        if op is not None:
            op.done = True
        else:
            # Before its send registered: while a large send was still being written, or on
            # replay, where notices of logged messages come again before they are re-sent.
            self.early.add((msg.src, msg.tag))

    def claim(self, entry: Any) -> None:
        """A matched probe took ``entry`` out of the unexpected queue."""
        self.matcher.remove(entry)
        self._matched(entry[0])
        self._flush_notices()

    # ---- receiving -----------------------------------------------------------------------

    def post(self, op: Any) -> None:
        """Post a receive: it takes a queued message now or waits in the posted queue."""
        if op.src == ANY_SOURCE:
            self.ft.any_post(op)  # replay: the logged source; live: log the match
        entry = self.matcher.post(op)
        if entry is not None:
            if op.src == ANY_SOURCE:
                self.ft.matched(op, entry[0].src)
            self._matched(entry[0])
            op.complete(entry[0], entry[1])
            self._flush_notices()

    def wait(self, op: Any) -> None:
        """Make progress until ``op.done``."""
        transport = self.transport
        ft = self.ft
        while not op.done:
            if transport is None:
                raise _no_peers()
            self.advance_schedules()
            if op.done:
                break
            if ft.replaying and ft.pump():
                continue
            if ft.pending:
                ft.flush()  # records go out before blocking: acked while we wait
            transport.progress(True)
            if self.notices:
                self._flush_notices()
            if transport.ckpt_request is not None:
                self.checkpoint()

    def block(self) -> None:
        """Wait for anything to arrive (callers re-check their condition)."""
        if self.transport is None:
            raise _no_peers()
        self.advance_schedules()
        ft = self.ft
        if ft.replaying and ft.pump():
            return
        if ft.pending:
            ft.flush()
        self.transport.progress(True)
        if self.notices:
            self._flush_notices()
        if self.transport.ckpt_request is not None:
            self.checkpoint()

    def poke(self) -> None:
        """Take in whatever has arrived, without blocking."""
        if self.transport is not None:
            self.transport.progress(False)
            if self.notices:
                self._flush_notices()
            if len(self.ft.pending) >= BATCH:
                self.ft.flush()
            if self.transport.ckpt_request is not None:
                self.checkpoint()
        self.advance_schedules()

    def checkpoint(self) -> None:
        """A ``CheckpointRequest`` was read: take it here, at engine level (not while
        replaying: then the request stays and a later call takes it)."""
        if self.ckpt is None:
            self.transport.ckpt_request = None  # checkpoints are not enabled here
        else:
            self.ckpt.on_request()

    def advance_schedules(self) -> None:
        """Step open non-blocking collectives whose receives completed (never from transport
        callbacks: a step sends, and the transport is not re-entrant)."""
        if not self.schedules or self.advancing:
            return
        self.advancing = True
        try:
            for sched in list(self.schedules):
                sched.step()
        finally:
            self.advancing = False

    # ---- transport sink ------------------------------------------------------------------

    def on_small(self, msg: Data, view: memoryview) -> None:
        if msg.ctx == CTX_MATCHED:
            self._on_notice(msg)
            return
        op = self.matcher.arrive(msg)
        if op is not None:
            if op.src == ANY_SOURCE:
                self.ft.matched(op, msg.src)
            self._matched(msg)
            op.complete_view(msg, view)
        else:
            self.matcher.stash(msg, bytearray(view) if msg.parts else bytes(view))

    def on_header(self, msg: Data, nbytes: int) -> tuple[memoryview, Any]:
        op = self.matcher.arrive(msg)
        if op is not None:
            if op.src == ANY_SOURCE:
                self.ft.matched(op, msg.src)
            self._matched(msg)
            target = op.direct(nbytes)
            if target is not None:
                return target, (op, True)
        return memoryview(bytearray(nbytes)), (op, False)

    def on_payload(self, msg: Data, view: memoryview, token: Any) -> None:
        op, direct = token
        if direct:
            op.complete_direct(msg, view.nbytes)
            return
        if op is None:
            # Receives posted while the payload was streaming in may want it now.
            op = self.matcher.arrive(msg)
            if op is None:
                self.matcher.stash(msg, view.obj)
                return
            if op.src == ANY_SOURCE:
                self.ft.matched(op, msg.src)
            self._matched(msg)
        op.complete(msg, view)


def _no_peers() -> errors.MPIException:
    # Waiting would hang forever: nothing can arrive without a connection to the agent.
    return errors.MPIException(
        errors.ERR_OTHER,
        "no message can ever arrive: MPI is finalized, or this single-rank run has no peers",
    )
