"""User-level failure mitigation (ULFM, MPI 5 / mpi4py 4.1): the communicator calls a program
uses to find out about failed processes and carry on without them (mixed into ``Comm``).

- ``Revoke``/``Is_revoked``: every member's later operations on the communicator fail with
  ``ERR_REVOKED`` (the engine's revocation: ``runtime`` module docstring);
- ``Get_failed``/``Ack_failed``: the members known failed here, in the order they were learnt;
  acknowledging the first ``num_to_ack`` of them lets receives from ANY_SOURCE and agreements go
  on despite them;
- ``Agree``/``Iagree``: the bitwise AND of an integer over the members still alive, with the
  same result at every member that returns, even when members fail during it; it raises
  ``ERR_PROC_FAILED`` where a failed member (known here, or to any member that took part) is not
  acknowledged here;
- ``Shrink``/``Ishrink``: a new communicator of the members not failed, in the same order, the
  failed set agreed on by the survivors.

How failures are known: only from the agent's ``Failed`` frames (the coordinator declared the
ranks failed and fenced them at the relays, so they never come back), in jobs whose failure mode
reports failures. In "transparent" jobs no process is ever reported failed: a lost rank is
restarted and replays, and these calls see a world without failures (revocation still works).

The agreement is flooding uniform consensus with a perfect failure detector (Guerraoui and
Rodrigues, "Introduction to Reliable Distributed Programming", algorithm 5.3): ``n`` rounds (``n``
members); in each, a member sends its state to every member not known failed and waits for the
state of each of them, or for its failure; the state merges (AND of the flags, union of the
failed sets, maximum of the next free context ids, which ``Shrink`` needs). After ``n`` rounds
every member that returns holds the same state. Its messages travel on the reserved context
``CTX_AGREE``, tagged with the communicator, the agreement's number and the round, so they match
no other traffic and survive revocation; agreements on one communicator are numbered apart from
its collectives (``Iagree`` may overlap a collective called in another order, as mpi4py's tests
do). In transparent jobs its rounds are logged like any non-blocking collective's.
"""

from __future__ import annotations

from typing import Any

import msgspec

from vpool.mpi import errors
from vpool.mpi.constants import UNDEFINED
from vpool.mpi.group import Group
from vpool.mpi.request import RecvOp, Request
from vpool.mpi.runtime import CTX_AGREE
from vpool.mpi.sched import Algo, Schedule, run
from vpool.protocol.messages import KIND_BUFFER
from vpool.protocol.rank_ft import K_TEST

_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.decode

_INT_MIN, _INT_MAX = -(1 << 31), (1 << 31) - 1


def _tag(ctx: int, seq: int, rnd: int) -> int:
    """The tag of round ``rnd`` of agreement ``seq`` on the communicator of context ``ctx``."""
    return (ctx << 40) | (seq << 20) | rnd


def failed_members(eng: Any, h: Any) -> list[int]:
    """World ranks of ``h``'s members known failed here, in the order they were learnt."""
    w2c = h.w2c
    return [f for f in eng.failed if w2c[f] != UNDEFINED]


def _unacked(eng: Any, h: Any, known: set[int]) -> list[int]:
    mine = failed_members(eng, h)
    acked = set(mine[: eng.acked.get(h.ctx, 0)])
    return sorted(f for f in known.union(mine) if f not in acked)


class Agreement:
    """The state of one agreement: what every round floods (see the module docstring)."""

    __slots__ = ("flag", "known", "next_ctx")

    def __init__(self, flag: int, known: set[int], next_ctx: int) -> None:
        self.flag = flag
        self.known = known
        self.next_ctx = next_ctx

    def merge(self, payload: Any) -> None:
        flag, known, next_ctx = _decode(payload)
        self.flag &= int(flag)
        self.known.update(int(f) for f in known)
        self.next_ctx = max(self.next_ctx, int(next_ctx))


def agreement(h: Any, flag: int) -> Algo:
    """Flooding uniform consensus over ``h``'s members; returns the decided ``Agreement``."""
    eng = h.eng
    seq = eng.agreements.get(h.ctx, 0)
    eng.agreements[h.ctx] = seq + 1
    members = h.group
    me = eng.rank
    state = Agreement(flag, set(failed_members(eng, h)), eng.next_ctx)
    for rnd in range(len(members)):
        tag = _tag(h.ctx, seq, rnd)
        state.known.update(failed_members(eng, h))
        payload = _encode([state.flag, sorted(state.known), state.next_ctx])
        peers = [w for w in members if w != me and w not in eng.failed_set]
        ops = []
        for w in peers:
            op = RecvOp(CTX_AGREE, w, tag, None, h.w2c)
            eng.post(op)
            ops.append(op)
        for w in peers:
            eng.send_quiet(w, CTX_AGREE, tag, KIND_BUFFER, [], [payload], len(payload))
        if ops:
            yield ops
        for op in ops:
            if not op.error:  # else: failed during the round (ERR_PROC_FAILED)
                state.merge(op.payload)
    return state


def _flag(value: Any) -> int:
    flag = int(value)
    if not _INT_MIN <= flag <= _INT_MAX:
        raise OverflowError(f"flag {flag} does not fit a C int")
    return flag


def _decided(h: Any, state: Agreement) -> int:
    """The agreed flag, or ``ERR_PROC_FAILED`` if a failure is not acknowledged here."""
    unacked = _unacked(h.eng, h, state.known)
    if unacked:
        ranks = ", ".join(str(h.w2c[f]) for f in unacked)
        raise errors.MPIException(errors.ERR_PROC_FAILED, f"not acknowledged: ranks {ranks}")
    return state.flag


def _int_buffer(buf: Any) -> memoryview:
    """mpi4py's checks on ``Iagree``'s buffer: a writable buffer of one C int."""
    try:
        view = memoryview(buf)
    except TypeError:
        raise TypeError(f"expected a buffer object, got {type(buf).__name__}") from None
    if view.readonly:
        raise BufferError("Object is not writable.")
    if view.nbytes != 4:
        raise ValueError(f"expected a buffer of one int (4 bytes), got {view.nbytes} bytes")
    return view.cast("B").cast("i")


def _shrunk(h: Any, state: Agreement, cls: type) -> Any:
    from vpool.mpi.comm import _Core

    eng = h.eng
    survivors = tuple(w for w in h.group if w not in state.known)
    ctx = state.next_ctx
    eng.next_ctx = max(eng.next_ctx, ctx + 2)
    core = _Core(eng, ctx, survivors)
    core.errh = h.errh
    if len(survivors) == h.size:
        core.topo = h.topo
    return cls._wrap(core)


class CommULFM:
    """ULFM calls of every communicator (mixed into ``Comm``)."""

    _core: Any
    _wrap: Any

    def Revoke(self) -> None:
        h = self._core()
        h.eng.revoke(h.ctx, tuple(h.group))

    def Is_revoked(self) -> bool:
        h = self._core()
        eng = h.eng
        ctx = h.ctx
        if ctx in eng.revoked:
            return True
        if eng.eager:
            eng.poke()
            return ctx in eng.revoked

        # Transparent: whether a pill has arrived yet is timing, so a logged test.
        def pilled() -> bool:
            return any(c == ctx for _, c in eng.matcher.pills)

        def live() -> bool | None:
            if not pilled():
                eng.poke()
            return True if pilled() else None

        if eng.ft.decide(K_TEST, live, lambda _: pilled()) is None:
            return False
        eng.revoked.add(ctx)
        return True

    def Get_failed(self) -> Group:
        h = self._core()
        h.eng.poke()
        return Group._of(failed_members(h.eng, h), h.eng.rank)

    def Ack_failed(self, num_to_ack: int | None = None) -> int:
        h = self._core()
        eng = h.eng
        n = len(failed_members(eng, h))
        want = n if num_to_ack is None else min(max(int(num_to_ack), 0), n)
        acked = max(eng.acked.get(h.ctx, 0), want)
        eng.acked[h.ctx] = acked
        return acked

    def Agree(self, flag: int) -> int:
        h = self._core()
        state = run(h, agreement(h, _flag(flag)), tolerant=True)
        return _decided(h, state)

    def Iagree(self, flag: Any) -> Request:
        h = self._core()
        view = _int_buffer(flag)

        def algo() -> Algo:
            state = yield from agreement(h, view[0])
            view[0] = state.flag  # agreed even when the call then raises ERR_PROC_FAILED
            _decided(h, state)

        return Request._of(Schedule(algo(), h.eng, tolerant=True))

    def Shrink(self) -> Any:
        h = self._core()
        state = run(h, agreement(h, 0), tolerant=True)
        return _shrunk(h, state, type(self))

    def Ishrink(self) -> tuple[Any, Request]:
        h = self._core()
        out = type(self)._wrap(None)

        def algo() -> Algo:
            state = yield from agreement(h, 0)
            out._h = _shrunk(h, state, type(out))._h

        return out, Request._of(Schedule(algo(), h.eng, tolerant=True))
