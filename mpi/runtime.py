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

Failures (ULFM, ``vpool.mpi.ulfm``). In a job whose failure mode reports failures the agent sends
``Failed(ranks)``; ``on_failed`` marks them: receives naming a failed source, and receives of a
collective in a communicator with a failed member, complete with ``ERR_PROC_FAILED``, as do
synchronous sends to a failed rank; later sends to one raise it; messages from a failed rank that
arrive after its notice are dropped (not its revocation notices: revoking, then dying at once,
must still revoke). A receive from ``ANY_SOURCE`` in a communicator with
failures not acknowledged (``Comm.Ack_failed``) stays posted: waiting on it raises
``ERR_PROC_FAILED_PENDING`` (``ERR_PROC_FAILED`` in a blocking ``Recv``, which withdraws it).
In a transparent job (which replays) ``Failed`` names only lost workers of reported spawns
(``spawn``), and takes effect only at logged tests (``observe``).

Revocation. A revoked communicator's p2p context is in ``revoked``: every later operation on it
raises ``ERR_REVOKED`` (``enter``, ``send``, ``post``). The revoker sends every member a notice
(a "pill": ``Data`` on the reserved context ``CTX_REVOKE``, tag = the communicator's context,
payload = its members), and every rank forwards the first pill it gets for a context to every
member, so the revocation reaches all even if the revoker dies at once (the forward is an
asynchronous send: positioned, logged and replayed as the match notices are). When a pill is
noticed depends on the failure mode (``eager``):

- reporting modes (ulfm): at once; every pending operation on the communicator fails;
- "transparent": only at points that replay the same way. A pill is a sticky entry at the end of
  its sender's channel, in the communicator's two contexts: a receive (or probe) that names the
  sender, or ANY_SOURCE (its match is logged), and that no earlier message of the sender
  matched, fails with ``ERR_REVOKED``; likewise a synchronous send to the sender. The context
  joins ``revoked`` where the program observes that (the receive's completion, a blocking
  collective, ``Is_revoked``, which is a logged test, or its own ``Revoke``). Since every member
  forwards, every member's channel to every other ends with a pill, so no operation on a revoked
  communicator waits forever.
"""

from __future__ import annotations

from array import array
from typing import Any

from vpool.mpi import errors
from vpool.mpi.constants import ANY_SOURCE, UNDEFINED
from vpool.mpi.matching import PILL, Matcher
from vpool.mpi.request import RecvOp
from vpool.mpi.transport import Transport, die
from vpool.protocol.messages import KIND_BUFFER, Data
from vpool.protocol.rank_ft import BATCH, FT, K_TEST

KIND_SYNC = 0x10  # flag on Data.kind: the sender waits until the message is matched
CTX_MATCHED = -1  # reserved context of "your synchronous message seq=tag was matched" notices
CTX_REVOKE = -3  # reserved context of revocation notices: tag = the revoked communicator's ctx
CTX_AGREE = -5  # reserved context of agreements (``ulfm``): never revoked, never a collective's
CTX_REBUILD = -7  # reserved context of a spawned process's role in a rebuild job (``ftmpi``)
PILL_TAG = -(1 << 62)  # the tag of a pill in the unexpected queue (matches any receive's tag)


class SyncSendOp:
    """A synchronous send: done once the receiver matched it (or failed, or revoked)."""

    __slots__ = ("ctx", "done", "dst", "error")

    def __init__(self, dst: int = -1, ctx: int = 0) -> None:
        self.done = False
        self.dst = dst
        self.ctx = ctx
        self.error = errors.SUCCESS

    def fail(self, code: int) -> None:
        self.error = code
        self.done = True

    def finish(self, status: Any) -> None:
        if status is not None:
            status._fill(-2, -1, 0, self.error)  # ANY_SOURCE, ANY_TAG: a send's status says nothing
        if self.error:
            raise errors.MPIException(self.error)
        return None


class Engine:
    __slots__ = (
        "acked",
        "advancing",
        "agreements",
        "answers",
        "broken",
        "ckpt",
        "cut",
        "eager",
        "early",
        "failed",
        "failed_set",
        "forwarded",
        "ft",
        "heard",
        "job",
        "local_seq",
        "matcher",
        "next_ctx",
        "notices",
        "parent",
        "rank",
        "revoke_groups",
        "revoked",
        "schedules",
        "size",
        "spawns",
        "strict",
        "syncs",
        "transport",
        "universe",
        "w2c_of",
        "watch",
        "world",
    )

    def __init__(self, job: int, rank: int, size: int) -> None:
        self.job = job
        self.rank = rank
        # Rank numbers of the job (its first ranks and every one it may spawn): what arrays
        # indexed by a world rank cover. COMM_WORLD is ``world``, the ranks this process
        # started with (``spawn``).
        self.size = size
        self.world: tuple[int, ...] = tuple(range(size))
        self.universe = size  # MPI.UNIVERSE_SIZE
        # Dynamic processes (``spawn``): the spawns this rank was the root of, the agent's
        # answers not taken yet (by seq), and the intercommunicator to the parents.
        self.spawns = 0
        self.answers: dict[int, Any] = {}
        self.parent: Any = None
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
        # Failures and revocations (module docstring). ``broken``: any known (the one test of
        # the fast paths); ``eager``: the job's failure mode reports failures (not transparent).
        self.broken = False
        self.eager = False
        # FT-MPI's modes (``ftmpi``: blank, shrink, rebuild): a failure breaks every
        # communicator it is a member of, until COMM_WORLD is rebuilt (``Comm.Dup``).
        self.strict = False
        self.failed: list[int] = []  # failed world ranks, in the order they were learnt
        self.failed_set: set[int] = set()
        self.acked: dict[int, set[int]] = {}  # ctx -> failures acknowledged on that communicator
        self.revoked: set[int] = set()  # p2p contexts of communicators known revoked
        self.forwarded: set[int] = set()  # contexts a pill came for (its forward is queued)
        self.revoke_groups: dict[int, tuple[int, ...]] = {}  # ctx -> members (pills' payload)
        self.w2c_of: dict[int, Any] = {}  # ctx -> world-to-comm map, for ANY_SOURCE probes
        self.agreements: dict[int, int] = {}  # ctx -> agreements started on it (``ulfm``)
        # Transparent mode: failures of reported spawns (``observe``). ``watch``: the ranks
        # of the reported spawns this rank took part in; ``heard``: ranks the agent said
        # failed, not observed yet; ``cut``: per failed rank, the last seq of it kept (later
        # ones are dropped, as in the logged run).
        self.watch: set[int] = set()
        self.heard: list[int] = []
        self.cut: dict[int, int] = {}
        self.matcher.on_miss = None

    # ---- sending -------------------------------------------------------------------------

    def send(
        self, dst: int, ctx: int, tag: int, kind: int, parts: list[int], bufs: list[Any], n: int
    ) -> None:
        """Send one message to world rank ``dst``; eager: returns once it is on its way."""
        if self.broken:
            self.check_send(dst, ctx)
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
        if self.broken:
            self.check_send(dst, ctx)
        op = SyncSendOp(dst, ctx)
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
                if self.broken and (dst, ctx) in self.matcher.pills:
                    op.fail(errors.ERR_REVOKED)  # the receiver's channel already ended
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
        """Send one asynchronous notice: a match notice to ``src`` for its message ``seq``,
        or (``src`` -1) the pills forwarding the revocation of context ``seq``."""
        if src < 0:
            self.send_pills(seq)
        elif self.transport is not None and src not in self.failed_set:
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
        if self.broken and op.ctx >= 0 and op.ctx & -2 in self.revoked:
            op.error = errors.ERR_REVOKED
            op.done = True
            return
        if op.src == ANY_SOURCE:
            self.ft.any_post(op)  # replay: the logged source; live: log the match
        entry = self.matcher.post(op)
        if entry is not None:
            if op.src == ANY_SOURCE:
                self.ft.matched(op, entry[0].src)
            if entry[1] is PILL:
                op.error = errors.ERR_REVOKED  # the sender's channel ended for this context
                op.done = True
                return
            self._matched(entry[0])
            op.complete(entry[0], entry[1])
            self._flush_notices()
        elif self.failed and self._doomed(op, self.failed):
            self.matcher.cancel(op)
            self._fail(op, errors.ERR_PROC_FAILED)

    def wait(self, op: Any, request: bool = False) -> None:
        """Make progress until ``op.done``. A receive from ANY_SOURCE in a communicator with
        unacknowledged failures raises: ``ERR_PROC_FAILED_PENDING`` for a ``request`` (which
        stays pending), else ``ERR_PROC_FAILED`` (a blocking receive: withdrawn)."""
        transport = self.transport
        ft = self.ft
        while not op.done:
            if self.failed and self.pending_failure(op):
                if request:
                    raise errors.MPIException(errors.ERR_PROC_FAILED_PENDING)
                self.matcher.cancel(op)
                ft.any_ops.pop(op, None)
                raise errors.MPIException(errors.ERR_PROC_FAILED)
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
        if msg.ctx < 0:
            if msg.ctx == CTX_REVOKE:
                # Even from a rank declared failed: a revoker may die right after revoking,
                # and its notice may come after the news of its death.
                self.on_pill(msg.src, msg.tag, tuple(array("i", bytes(view))))
                return
            if (self.failed_set or self.cut) and self._late(msg):
                return  # from a rank declared failed: dropped
            if msg.ctx == CTX_MATCHED:
                self._on_notice(msg)
                return
        elif (self.failed_set or self.cut) and self._late(msg):
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
        if (self.failed_set or self.cut) and self._late(msg):
            return memoryview(bytearray(nbytes)), (None, None)  # read, then dropped
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
        if direct is None or ((self.failed_set or self.cut) and self._late(msg)):
            return  # from a rank declared failed
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

    # ---- failures (ULFM) -----------------------------------------------------------------

    def on_failed(self, ranks: list[int]) -> None:
        """The agent's ``Failed``: the job's ranks declared failed so far (a transport
        callback: nothing is sent from here). In reporting modes they apply at once; in a
        transparent job (workers of a reported spawn) they wait for ``observe``."""
        new = [
            r for r in ranks if 0 <= r < self.size and r != self.rank and r not in self.failed_set
        ]
        if not new:
            return
        if not self.eager:
            self.heard.extend(r for r in new if r not in self.heard)
            return
        self.apply_failed(new)

    def observe(self) -> None:
        """Transparent mode: the failures heard so far take effect here, a logged test (its
        outcome: each failed rank with the seq of the last message of it this rank took in;
        later ones are dropped). A replay applies the logged ones at the same event, once
        their messages up to those seqs came again, and drops the later ones from the start
        (``load_cuts``). Made at deterministic points only, and only by a rank that took part
        in a reported spawn (``watch``): ANY_SOURCE receives and probes on a communicator
        with such a worker, ``Get_failed``, ``Ack_failed``."""
        t = self.transport
        if t is None or self.eager:
            return

        def live() -> Any:
            new = [r for r in self.heard if r not in self.failed_set]
            return {"failed": [[r, t.received[r]] for r in new]} if new else None

        def ready(value: Any) -> bool:
            return all(t.received[r] >= seq for r, seq in _failures(value))

        value = self.ft.decide(K_TEST, live, ready)
        if value is None:
            return
        pairs = _failures(value)
        for r, seq in pairs:
            self.cut[r] = seq
        done = {r for r, _ in pairs}
        self.heard = [r for r in self.heard if r not in done]
        self.apply_failed([r for r, _ in pairs if r not in self.failed_set])

    def load_cuts(self, records: Any) -> None:
        """Determinant records of a replay (``Transport``): the logged failures' cuts, known
        before any message of theirs comes again."""
        for rec in records:
            if len(rec) == 4 and rec[0] == 0 and rec[2] == K_TEST and type(rec[3]) is dict:
                for r, seq in _failures(rec[3]):
                    self.cut[r] = max(seq, self.cut.get(r, 0))

    def _late(self, msg: Data) -> bool:
        """A message of a rank declared failed, after its cut: dropped."""
        return msg.src in self.failed_set or msg.seq > self.cut.get(msg.src, msg.seq)

    def apply_failed(self, new: list[int]) -> None:
        if not new:
            return
        self.failed.extend(new)
        self.failed_set.update(new)
        self.broken = True
        t = self.transport
        if t is not None:
            for r in new:
                # What was sent to it needs no acknowledgement to finalize: it is gone.
                t.acked[r] = max(t.acked[r], t.sent[r])
        self.matcher.on_miss = self.probe_miss
        for op in list(self.matcher.posted):
            if self._doomed(op, new):
                self.matcher.cancel(op)
                self._fail(op, errors.ERR_PROC_FAILED)
        for key, sop in list(self.syncs.items()):
            if key[0] in self.failed_set:
                del self.syncs[key]
                sop.fail(errors.ERR_PROC_FAILED)

    def watches(self, h: Any) -> bool:
        """Whether ``h`` has a member of a reported spawn (``observe``)."""
        pw2c = getattr(h, "pw2c", h.w2c)
        return any(pw2c[r] != UNDEFINED for r in self.watch)

    # ---- dynamic processes (``spawn``) -------------------------------------------------------

    def on_spawned(self, msg: Any) -> None:
        """The agent's ``Spawned``: kept for the ``Spawn`` of that seq (a transport callback)."""
        self.answers[msg.seq] = msg

    def _doomed(self, op: Any, failed: list[int]) -> bool:
        """Can posted receive ``op`` never complete, given ``failed``? It names one, or it is
        a collective's (odd context) in a communicator with a failed member; in FT-MPI's
        modes (``strict``), any receive in a communicator a failure broke."""
        if op.src in failed:
            return True
        ctx = op.ctx
        if ctx < 0:
            return False  # the runtime's own protocols: only their source's failure
        if self.strict:
            return self.broken_by(ctx, op.w2c, failed) is not None
        if ctx & 1:
            w2c = op.w2c
            return any(w2c[f] != UNDEFINED for f in failed)
        return False

    def broken_by(self, ctx: int, w2c: Any, failed: list[int]) -> int | None:
        """FT-MPI's modes: the first member of the communicator of ``ctx`` (``w2c``) in
        ``failed`` and not acknowledged on it (a blank communicator's holes are), if any."""
        acked = self.acked.get(ctx & -2, ())
        return next((f for f in failed if w2c[f] != UNDEFINED and f not in acked), None)

    def _fail(self, op: Any, code: int) -> None:
        self.ft.any_ops.pop(op, None)
        op.error = code
        op.done = True

    def unacked(self, ctx: int, w2c: Any) -> int:
        """How many failures among ``w2c``'s ranks are not acknowledged on ``ctx``."""
        acked = self.acked.get(ctx, ())
        return sum(1 for f in self.failed if w2c[f] != UNDEFINED and f not in acked)

    def pending_failure(self, op: Any) -> bool:
        """``op`` is a pending receive from ANY_SOURCE that a failure leaves pending."""
        return (
            type(op) is RecvOp
            and not op.done
            and op.src == ANY_SOURCE
            and op.ctx >= 0
            and self.unacked(op.ctx, op.w2c) > 0
        )

    def check_send(self, dst: int, ctx: int) -> None:
        if ctx >= 0 and ctx & -2 in self.revoked:
            raise errors.MPIException(errors.ERR_REVOKED)
        if dst in self.failed_set:
            raise errors.MPIException(errors.ERR_PROC_FAILED, f"rank {dst} failed")

    def enter(self, h: Any, any_source: bool = False) -> None:
        """A point-to-point call on communicator ``h`` starts (``p2p``): refused once it is
        revoked; an ANY_SOURCE probe's communicator is remembered (``probe_miss``)."""
        if any_source:
            self.w2c_of[h.ctx] = getattr(h, "pw2c", h.w2c)  # the group ANY_SOURCE means
            if self.watch and self.watches(h):
                self.observe()
        if self.broken and h.ctx & -2 in self.revoked:
            raise errors.MPIException(errors.ERR_REVOKED)
        if self.strict and self.failed:
            self.check_broken(h)

    def check_broken(self, h: Any) -> None:
        """FT-MPI's modes: a communicator a failure broke refuses every operation until
        COMM_WORLD is rebuilt (``ftmpi``)."""
        maps = (h.w2c,) if h.pw2c is h.w2c else (h.w2c, h.pw2c)  # an intercomm's both groups
        for w2c in maps:
            f = self.broken_by(h.ctx, w2c, self.failed)
            if f is not None:
                raise errors.MPIException(
                    errors.ERR_PROC_FAILED,
                    f"world rank {f}, a member of the communicator, failed: recover with "
                    "MPI.COMM_WORLD.Dup()",
                )

    def enter_collective(self, h: Any) -> None:
        """A collective on ``h`` starts: refused once revoked, or with a member failed."""
        if h.ctx & -2 in self.revoked:
            raise errors.MPIException(errors.ERR_REVOKED)
        if self.failed:
            w2c = h.w2c
            for f in self.failed:
                if w2c[f] != UNDEFINED:
                    raise errors.MPIException(
                        errors.ERR_PROC_FAILED, f"rank {w2c[f]} of the communicator failed"
                    )

    def probe_miss(self, ctx: int, src: int) -> None:
        """A probe found nothing (``Matcher.on_miss``): raise if nothing can come."""
        if ctx >= 0 and ctx & -2 in self.revoked:
            raise errors.MPIException(errors.ERR_REVOKED)
        if src in self.failed_set:
            raise errors.MPIException(errors.ERR_PROC_FAILED, f"rank {src} failed")
        if src == ANY_SOURCE and ctx >= 0:
            w2c = self.w2c_of.get(ctx & -2)
            if w2c is not None and self.unacked(ctx & -2, w2c) > 0:
                raise errors.MPIException(errors.ERR_PROC_FAILED)

    def probed(self, entry: Any) -> Any:
        """What a probe found: a pill means the sender's channel ended (``p2p``)."""
        if entry is not None and type(entry) is tuple and entry[1] is PILL:
            self.revoked.add(entry[0].ctx & -2)
            raise errors.MPIException(errors.ERR_REVOKED)
        return entry

    # ---- revocation ------------------------------------------------------------------------

    def revoke(self, ctx: int, group: tuple[int, ...]) -> None:
        """This rank revokes the communicator of p2p context ``ctx`` (members ``group``)."""
        if ctx in self.revoked:
            return
        self.broken = True
        self.revoked.add(ctx)
        self.revoke_groups.setdefault(ctx, group)
        self._revoke_pending(ctx, None)
        self.send_pills(ctx)

    def on_pill(self, src: int, ctx: int, group: tuple[int, ...]) -> None:
        """A revocation notice from ``src`` (a transport callback: nothing is sent here)."""
        self.broken = True
        self.revoke_groups.setdefault(ctx, group)
        if ctx not in self.forwarded:
            # The first notice is forwarded to every member, as a match notice is sent: logged
            # where it went out, so a replay (whose first notice is the same) goes the same way.
            # Even by the revoker, in transparent mode: whether its own Revoke came first is
            # timing. In reporting modes nothing replays: a rank that revoked does not forward.
            self.forwarded.add(ctx)
            if not (self.eager and ctx in self.revoked):
                self.notices.append((-1, ctx))
        if self.eager:
            self.revoked.add(ctx)
            self._revoke_pending(ctx, None)
        else:
            self._revoke_pending(ctx, src)
            self.matcher.add_pill(self._pill(src, ctx), self._pill(src, ctx + 1))

    def _pill(self, src: int, ctx: int) -> Data:
        return Data(self.job, src, self.rank, 0, ctx, PILL_TAG, KIND_BUFFER, [])

    def _revoke_pending(self, ctx: int, src: int | None) -> None:
        """Fail the pending operations on the communicator of ``ctx``: all (``src`` None), or
        those a pill of ``src`` ends (receives naming it or ANY_SOURCE, its synchronous sends)."""
        for op in list(self.matcher.posted):
            if op.ctx != ctx and op.ctx != ctx + 1:
                continue
            if src is None or op.src == src:
                self.matcher.cancel(op)
                self._fail(op, errors.ERR_REVOKED)
            elif op.src == ANY_SOURCE:
                self.matcher.cancel(op)
                self.ft.matched(op, src)  # which pill it took is an ANY_SOURCE outcome
                self._fail(op, errors.ERR_REVOKED)
        for key, sop in list(self.syncs.items()):
            if sop.ctx == ctx and (src is None or key[0] == src):
                del self.syncs[key]
                sop.fail(errors.ERR_REVOKED)

    def send_pills(self, ctx: int) -> None:
        """Tell every other member (not failed) that ``ctx`` is revoked."""
        group = self.revoke_groups.get(ctx, ())
        payload = array("i", group).tobytes()
        t = self.transport
        if t is None:
            return
        for w in group:
            if w != self.rank and w not in self.failed_set:
                t.send_data(w, CTX_REVOKE, ctx, KIND_BUFFER, [], [payload], len(payload))

    def send_quiet(
        self, dst: int, ctx: int, tag: int, kind: int, parts: list[int], bufs: list[Any], n: int
    ) -> None:
        """A send of the runtime's own protocols (agreements): never refused, dropped when the
        destination is known failed."""
        if dst in self.failed_set:
            return
        if dst == self.rank:
            self._send_local(ctx, tag, kind, parts, bufs)
        elif self.transport is not None:
            self.transport.send_data(dst, ctx, tag, kind, parts, bufs, n)


def _failures(value: Any) -> list[tuple[int, int]]:
    """The (rank, cut) pairs of a logged failure outcome (``Engine.observe``)."""
    try:
        return [(int(r), int(seq)) for r, seq in value["failed"]]
    except (TypeError, KeyError, ValueError):
        die(f"program is not deterministic: a logged test holds {value!r}, not failures")
        raise


def _no_peers() -> errors.MPIException:
    # Waiting would hang forever: nothing can arrive without a connection to the agent.
    return errors.MPIException(
        errors.ERR_OTHER,
        "no message can ever arrive: MPI is finalized, or this single-rank run has no peers",
    )
