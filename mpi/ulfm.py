"""User-level failure mitigation (ULFM, MPI 5 / mpi4py 4.1): the communicator calls a program
uses to find out about failed processes and carry on without them (mixed into ``Comm``).

- ``Revoke``/``Is_revoked``: every member's later operations on the communicator fail with
  ``ERR_REVOKED`` (the engine's revocation: ``runtime`` module docstring);
- ``Get_failed``/``Ack_failed``: the members known failed here, in the order they were learnt;
  acknowledging the first ``num_to_ack`` of them lets receives from ANY_SOURCE and agreements go
  on despite them;
- ``Agree``/``Iagree``: the bitwise AND of an integer over the members still alive (on an
  intercommunicator: over the other group's), with the same result at every member that
  returns, even when members fail during it; it raises ``ERR_PROC_FAILED`` at every member alike
  when a failure it agreed on was not acknowledged by every member that took part;
- ``Shrink``/``Ishrink``: a new communicator of the members not failed, in the same order, the
  failed set agreed on by the survivors (of both groups, for an intercommunicator).

How failures are known: only from the agent's ``Failed`` frames (the coordinator declared the
ranks failed and fenced them at the relays, so they never come back), in jobs whose failure mode
reports failures. In "transparent" jobs no process is ever reported failed: a lost rank is
restarted and replays, and these calls see a world without failures (revocation still works).

The agreement is flooding uniform consensus with a perfect failure detector (Guerraoui and
Rodrigues, "Introduction to Reliable Distributed Programming", algorithm 5.3): ``n`` rounds (``n``
members); in each, a member sends its state to every member not known failed and waits for the
state of each of them, or for its failure; the state merges (AND of the flags, union of the
failed sets, maximum of the next free context ids, which ``Shrink`` needs). After ``n`` rounds
every member that returns holds the same state. An intercommunicator's agreement runs over both
groups, keeping one AND per group. Its messages travel on the reserved context
``CTX_AGREE``, tagged with the communicator, the agreement's number and the round, so they match
no other traffic and survive revocation; agreements on one communicator are numbered apart from
its collectives (``Iagree`` may overlap a collective called in another order, as mpi4py's tests
do). In transparent jobs its rounds are logged like any non-blocking collective's.
"""

from __future__ import annotations

from typing import Any

import msgspec

from vpool.mpi import errors
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


def members(h: Any) -> tuple[int, ...]:
    """World ranks of every member of ``h``: an intercommunicator's remote group too."""
    remote = getattr(h, "remote", None)
    return tuple(h.group) if remote is None else (*h.group, *remote)


def failed_members(eng: Any, h: Any) -> list[int]:
    """World ranks of ``h``'s members known failed here, in the order they were learnt."""
    mine = set(members(h))
    return [f for f in eng.failed if f in mine]


def acked_members(eng: Any, h: Any) -> set[int]:
    """The failures of ``h`` acknowledged here (``Ack_failed``)."""
    return set(eng.acked.get(h.ctx, ()))


class Agreement:
    """The state of one agreement: what every round floods and merges (module docstring).

    ``flags``: the AND of the flags contributed by each group (one group for an
    intracommunicator; an intercommunicator's members get the other group's); ``known``: the
    union of the failed sets; ``acked``: the intersection of the acknowledged ones (a failure
    raises unless every member that took part had acknowledged it); ``next_ctx``: the maximum
    of the next free context ids."""

    __slots__ = ("acked", "flags", "known", "next_ctx")

    def __init__(
        self, flags: dict[int, int], known: set[int], acked: set[int], next_ctx: int
    ) -> None:
        self.flags = flags
        self.known = known
        self.acked = acked
        self.next_ctx = next_ctx

    def encode(self) -> bytes:
        flags = sorted(self.flags.items())
        return _encode([flags, sorted(self.known), sorted(self.acked), self.next_ctx])

    def merge(self, payload: Any) -> None:
        flags, known, acked, next_ctx = _decode(payload)
        for group, flag in flags:
            have = self.flags.get(group)
            self.flags[group] = int(flag) if have is None else have & int(flag)
        self.known.update(int(f) for f in known)
        self.acked.intersection_update(int(f) for f in acked)
        self.next_ctx = max(self.next_ctx, int(next_ctx))


def _group_id(h: Any) -> int:
    """Which group of ``h`` this rank is in, as every member counts: 0 for an
    intracommunicator, else 0 for the group holding the lowest world rank."""
    remote = getattr(h, "remote", None)
    if remote is None:
        return 0
    return 0 if min(h.group) < min(remote) else 1


def agreement(h: Any, flag: int) -> Algo:
    """Flooding uniform consensus over ``h``'s members; returns the decided ``Agreement``."""
    eng = h.eng
    seq = eng.agreements.get(h.ctx, 0)
    eng.agreements[h.ctx] = seq + 1
    everyone = members(h)
    me = eng.rank
    state = Agreement(
        {_group_id(h): flag},
        set(failed_members(eng, h)),
        acked_members(eng, h),
        eng.next_ctx,
    )
    for rnd in range(len(everyone)):
        tag = _tag(h.ctx, seq, rnd)
        state.known.update(failed_members(eng, h))
        payload = state.encode()
        peers = [w for w in everyone if w != me and w not in eng.failed_set]
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


def _flag_of(h: Any, state: Agreement) -> int:
    """The agreed flag: the AND of this group's flags, or the remote group's (intercomm)."""
    group = _group_id(h)
    if getattr(h, "remote", None) is not None:
        group = 1 - group
    return state.flags.get(group, -1)  # a group all failed contributes nothing: all ones


def _check(state: Agreement) -> None:
    """``ERR_PROC_FAILED`` at every member alike, if a failure agreed on was not acknowledged
    by every member that took part before the call."""
    unacked = sorted(state.known - state.acked)
    if unacked:
        ranks = ", ".join(str(f) for f in unacked)
        raise errors.MPIException(
            errors.ERR_PROC_FAILED, f"failures not acknowledged everywhere: world ranks {ranks}"
        )


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
    remote = getattr(h, "remote", None)
    if remote is None:
        eng.next_ctx = max(eng.next_ctx, ctx + 2)
        core = _Core(eng, ctx, survivors)
        if len(survivors) == h.size:
            core.topo = h.topo
    else:
        eng.next_ctx = max(eng.next_ctx, ctx + 4)  # an intercommunicator takes four ids
        core = _Core(eng, ctx, survivors, remote=tuple(w for w in remote if w not in state.known))
    core.errh = h.errh
    return cls._wrap(core)


class CommULFM:
    """ULFM calls of every communicator (mixed into ``Comm``)."""

    _core: Any
    _wrap: Any

    def Revoke(self) -> None:
        h = self._core()
        everyone = members(h)
        h.eng.revoke(h.ctx, everyone)
        local = getattr(h, "local", None)
        if local is not None:  # an intercommunicator's collectives also run in its local core
            h.eng.revoke(local.ctx, everyone)

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
        if h.eng.watch:
            h.eng.observe()  # transparent: failures of reported spawns, at a logged point
        return Group._of(failed_members(h.eng, h), h.eng.rank)

    def Ack_failed(self, num_to_ack: int | None = None) -> int:
        h = self._core()
        eng = h.eng
        if eng.watch:
            eng.observe()
        failed = failed_members(eng, h)
        want = len(failed) if num_to_ack is None else max(int(num_to_ack), 0)
        acked = eng.acked.setdefault(h.ctx, set())
        acked.update(failed[:want])  # the first ones, in the order they were learnt
        return len(acked)

    def Agree(self, flag: int) -> int:
        h = self._core()
        state = run(h, agreement(h, _flag(flag)), tolerant=True)
        _check(state)
        return _flag_of(h, state)

    def Iagree(self, flag: Any) -> Request:
        h = self._core()
        view = _int_buffer(flag)

        def algo() -> Algo:
            state = yield from agreement(h, view[0])
            view[0] = _flag_of(h, state)  # agreed even when the call then raises
            _check(state)

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
