"""Intercommunicators: how they are made (``Intracomm.Create_intercomm``,
``Intercomm.Create_from_groups``) and what their management calls agree on (Dup, Split,
Split_type, Create, Merge).

An intercommunicator joins two disjoint groups. Its core (``comm._Core`` with ``remote``) keeps
the local group as ``group`` (Get_rank/Get_size answer in it) and the remote one as ``remote``;
point-to-point ranks name the remote group. It takes four context ids, agreed by the members of
both groups: ``ctx`` for point-to-point, ``ctx + 1`` for the collectives' messages between the
groups, ``ctx + 2``/``ctx + 3`` for its local core (``local``), an intracommunicator of the local
group in which collectives run their phases within a group (``intercoll``).

The functions here take cores and return what a new communicator is made of (a context id and
groups of world ranks); ``comm`` builds the cores. Every exchange names its source: nothing here
makes a timing-dependent choice.

- ``from_leaders`` (``Create_intercomm``): a reduce over the local communicator gives its leader
  the group's highest next free context id; the leader sends it with the local group to the
  remote leader over ``peer_comm`` and receives theirs, in the peer's collective context under a
  negative tag derived from ``tag`` (apart from its point-to-point and from its collectives);
  then it broadcasts the remote group and the agreed id in the local communicator.
- ``exchange``: a value from every member of both groups (an allgather in the local core and
  one between the groups), with a context id agreed on the way; the management calls of an
  intercommunicator go through it.
- ``union``: the order of both groups that ``Create_from_groups`` agrees over.
"""

from __future__ import annotations

from typing import Any

from vpool.mpi import coll, errors, intercoll, ops
from vpool.mpi.constants import UNDEFINED
from vpool.mpi.envelope import as_rank
from vpool.mpi.request import RecvOp
from vpool.mpi.sched import check, loads
from vpool.mpi.serialization import pickle_
from vpool.protocol.messages import KIND_PICKLE

SPAN = 4
"""Context ids an intercommunicator takes (see the module docstring)."""

_LEADER_TAGS = -(1 << 43)  # Create_intercomm's leader exchange, in the peer's collective context

Groups = tuple[int, tuple[int, ...], tuple[int, ...]]
"""A new intercommunicator: (context id, local group, remote group), world ranks."""


def _rank_error(what: str, rank: int, size: int) -> errors.MPIException:
    return errors.MPIException(errors.ERR_RANK, f"{what} {rank} of a {size}-rank communicator")


def from_leaders(
    h: Any, local_leader: Any, peer: Any, remote_leader: Any, tag: int
) -> tuple[int, tuple[int, ...]]:
    """``Create_intercomm`` over the local intracommunicator ``h``: (context id, remote group).
    ``peer`` (the peer communicator's core, or None) matters only at the local leader."""
    eng = h.eng
    leader = as_rank(local_leader)
    if not 0 <= leader < h.size:
        raise _rank_error("local leader", leader, h.size)
    mine = coll.reduce(h, eng.next_ctx, ops.MAX, leader)
    found: Any = None
    if h.rank == leader:
        try:
            found = (*_leaders_swap(h, mine, peer, remote_leader, tag), None)
        except errors.MPIException as exc:
            found = (0, (), (exc.Get_error_class(), str(exc)))
    # The leader's verdict reaches every member, so that an error raises everywhere.
    ctx, remote, error = coll.bcast(h, found, leader)
    if error is not None:
        raise errors.MPIException(error[0], error[1])
    eng.next_ctx = ctx + SPAN
    return int(ctx), tuple(remote)


def _leaders_swap(
    h: Any, mine: int, peer: Any, remote_leader: Any, tag: int
) -> tuple[int, tuple[int, ...]]:
    if peer is None:
        raise errors.MPIException(errors.ERR_COMM, "null peer communicator at the local leader")
    rl = as_rank(remote_leader)
    if not 0 <= rl < peer.psize:
        raise _rank_error("remote leader", rl, peer.psize)
    if tag < 0:
        raise errors.MPIException(errors.ERR_TAG, f"tag {tag}")
    eng = h.eng
    w = peer.peers[rl]
    ctx, t = peer.ctx + 1, _LEADER_TAGS - (tag & 0x7FFFFFFF)
    op = RecvOp(ctx, w, t, None, peer.pw2c)
    eng.post(op)
    bufs, parts = pickle_.dumps((h.group, mine))
    eng.send(w, ctx, t, KIND_PICKLE, parts, bufs, sum(parts) if parts else len(bufs[0]))
    if not op.done:
        eng.wait(op)
    check(op)
    remote, theirs = loads(op)
    if set(remote) & set(h.group):
        raise errors.MPIException(errors.ERR_COMM, "the local and remote groups overlap")
    return max(mine, theirs), tuple(remote)


def everyone(h: Any, value: Any) -> tuple[list[Any], list[Any]]:
    """``value`` from every member of the intercommunicator ``h``: (local group's, remote
    group's), each in rank order."""
    return coll.allgather(h.local, value), intercoll.allgather(h, value)


def exchange(h: Any, value: Any, span: int = SPAN) -> tuple[int, list[Any], list[Any]]:
    """``everyone`` with a context id agreed by both groups, of which the new communicator
    takes ``span``: (context id, local values, remote values)."""
    eng = h.eng
    local, remote = everyone(h, (eng.next_ctx, value))
    ctx = max(n for n, _ in local + remote)
    eng.next_ctx = ctx + span
    return int(ctx), [v for _, v in local], [v for _, v in remote]


def dup(h: Any) -> int:
    return exchange(h, None)[0]


def _chosen(group: tuple[int, ...], picks: list[tuple[int, int]], color: int) -> tuple[int, ...]:
    order = sorted((key, i) for i, (c, key) in enumerate(picks) if c == color)
    return tuple(group[i] for _, i in order)


def split(h: Any, color: int, key: int) -> Groups | None:
    """Intercommunicator ``Split``: the members of each group with this color, by key then
    rank; None (COMM_NULL) for UNDEFINED or when either side has none."""
    ctx, local, remote = exchange(h, (color, key))
    if color == UNDEFINED:
        return None
    theirs = _chosen(h.remote, remote, color)
    if not theirs:
        return None
    return ctx, _chosen(h.group, local, color), theirs


def both_in_order(h: Any, local: list[Any], remote: list[Any]) -> tuple[list[Any], int]:
    """Values of both groups in the same order at every member (``union``'s), and this
    member's place in it."""
    if h.group[0] < h.remote[0]:
        return local + remote, h.rank
    return remote + local, len(remote) + h.rank


def subset(h: Any, members: tuple[int, ...]) -> Groups | None:
    """Intercommunicator ``Create``: each group names a subgroup of itself; None (COMM_NULL)
    outside it or when the remote one is empty."""
    if not set(members) <= set(h.group):
        raise errors.MPIException(errors.ERR_GROUP, "not a subgroup of the local group")
    ctx, _, remote = exchange(h, members)
    theirs = tuple(remote[0])
    if h.eng.rank not in members or not theirs:
        return None
    return ctx, members, theirs


def merge(h: Any, high: bool) -> tuple[int, tuple[int, ...]]:
    """``Merge``: (context id, members) of the intracommunicator of both groups, the group that
    passed ``high`` false first (both alike: ``union``'s order)."""
    ctx, _, remote = exchange(h, bool(high), span=2)
    theirs = bool(remote[0])
    mine_first = (not high and theirs) or (bool(high) == theirs and h.group[0] < h.remote[0])
    members = h.group + h.remote if mine_first else h.remote + h.group
    return ctx, members


def union(local: tuple[int, ...], remote: tuple[int, ...]) -> tuple[int, ...]:
    """Both groups in the order all their members compute alike: first the group whose rank 0
    has the lower world rank."""
    if set(local) & set(remote):
        raise errors.MPIException(errors.ERR_GROUP, "the local and remote groups overlap")
    return local + remote if local[0] < remote[0] else remote + local
