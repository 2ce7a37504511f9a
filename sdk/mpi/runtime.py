"""The point-to-point engine of a rank: sends, posted receives, progress.

Sits between the communicators (which translate ranks and contexts) and the transport (bytes
on the socket). Messages to the rank itself never touch the socket: they are copied and matched
locally, since no channel (s, s) exists on the relays.

Progress happens only inside MPI calls: ``wait`` blocks in the transport until the operation it
waits for completes; ``poke`` reads whatever has arrived without blocking. There are no pending
writes between calls (sends complete when handed to the socket), so at every call boundary the
process state is plain data: the queues of the matcher and the transport's counters.
"""

from __future__ import annotations

from typing import Any

from vpool.protocol.messages import Data
from vpool.sdk.mpi import errors
from vpool.sdk.mpi.matching import Matcher
from vpool.sdk.mpi.transport import Transport


class Engine:
    __slots__ = ("job", "matcher", "next_ctx", "rank", "size", "transport")

    def __init__(self, job: int, rank: int, size: int) -> None:
        self.job = job
        self.rank = rank
        self.size = size
        self.matcher = Matcher()
        self.transport: Transport | None = None
        # Context ids: 0/1 are COMM_WORLD's, 2/3 COMM_SELF's (never on the wire); every new
        # communicator takes the next free even id, agreed by its members (``comm.agree_ctx``).
        self.next_ctx = 4

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

    def _send_local(self, ctx: int, tag: int, kind: int, parts: list[int], bufs: list[Any]) -> None:
        # Copy now: the sender may reuse its buffers as soon as the send returns.
        payload = bytearray().join(bufs) if parts else b"".join(bufs)
        msg = Data(self.job, self.rank, self.rank, 0, ctx, tag, kind, parts)
        op = self.matcher.arrive(msg)
        if op is not None:
            op.complete(msg, payload)
        else:
            self.matcher.stash(msg, payload)

    # ---- receiving -----------------------------------------------------------------------

    def post(self, op: Any) -> None:
        """Post a receive: it takes a queued message now or waits in the posted queue."""
        entry = self.matcher.post(op)
        if entry is not None:
            op.complete(entry[0], entry[1])

    def wait(self, op: Any) -> None:
        """Make progress until ``op.done``."""
        transport = self.transport
        while not op.done:
            if transport is None:
                raise _no_peers()
            transport.progress(True)

    def block(self) -> None:
        """Wait for anything to arrive (callers re-check their condition)."""
        if self.transport is None:
            raise _no_peers()
        self.transport.progress(True)

    def poke(self) -> None:
        """Take in whatever has arrived, without blocking."""
        if self.transport is not None:
            self.transport.progress(False)

    # ---- transport sink ------------------------------------------------------------------

    def on_small(self, msg: Data, view: memoryview) -> None:
        op = self.matcher.arrive(msg)
        if op is not None:
            op.complete_view(msg, view)
        else:
            self.matcher.stash(msg, bytearray(view) if msg.parts else bytes(view))

    def on_header(self, msg: Data, nbytes: int) -> tuple[memoryview, Any]:
        op = self.matcher.arrive(msg)
        if op is not None:
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
        op.complete(msg, view)


def _no_peers() -> errors.MPIException:
    # Waiting would hang forever: nothing can arrive without a connection to the agent.
    return errors.MPIException(
        errors.ERR_OTHER,
        "no message can ever arrive: MPI is finalized, or this single-rank run has no peers",
    )
