"""Dynamic processes: ``Intracomm.Spawn``/``Spawn_multiple`` and ``Comm.Get_parent``.

A spawn asks the pool (through the agent: ``SpawnRequest``/``Spawned``, docs/internals.md "Rank
<-> agent") for new processes, which become more ranks of the same job: rank numbers after the
job's highest, their own ``COMM_WORLD`` (``RankWelcome.world``), and an intercommunicator to
the spawning group (``RankWelcome.parent``, ``parent_ctx``).

``Spawn`` is collective over the spawning communicator, and the root's arguments are the ones
that count:

1. the members agree a context id span for the intercommunicator (``intercomm.SPAN`` ids, every
   member moving its next free id past them, as ``comm.agree_ctx`` does);
2. the root sends ``SpawnRequest(seq, command, maxprocs, least, parent, ctx, reported)``, ``seq``
   counting the spawns this rank was the root of (1, 2, ...), and waits for the ``Spawned`` of
   that seq, making progress meanwhile (the engine's ``block``: other ranks' messages, schedules
   and notices keep moving);
3. it broadcasts the answer over the communicator: every member returns the intercommunicator
   (local group: the communicator's, remote: the new ranks, context: the agreed one) or raises
   ``MPI.Exception`` with ``ERR_SPAWN`` and the pool's reason; ``errcodes`` gets one code per
   process asked for (``SUCCESS`` for those started, ``ERR_SPAWN`` for the others).

Info keys: ``soft`` (MPI's: ``"a:b"``, ``"a:b:c"``, ``"n"``, comma lists; the request's
``least`` is the smallest count it allows, ``maxprocs`` without it) and ``vpool_reported``
(true: a lost process of this spawn is declared failed and reported to the job's ranks, whatever
the job's failure mode; ``runtime.Engine.observe`` in transparent jobs). A soft spawn the pool
grants no process at all raises ``ERR_SPAWN`` too: an intercommunicator needs a remote group.

Determinism: a restarted root replays, asks again with the same seq and gets the same answer
from the pool (kept by root and seq), so nothing is logged here. An answer that comes before its
question (a replaying rank whose agent answered an earlier incarnation's request) waits in
``Engine.answers`` for the ``Spawn`` of its seq, which alone takes it.

``Spawn_multiple`` spawns one command per request: several commands that are all the same
(command and arguments, as ``mpi4py``'s tests use) are one request for the sum of their counts;
different ones raise ``NotImplementedError`` (the pool gives each spawn its own ``COMM_WORLD``,
and one ``Spawn_multiple`` must make a single one).

A spawned process's ``Get_parent`` is built at ``MPI.Init`` (``parent_core``); it is
``COMM_NULL`` once disconnected or freed, and in processes that were not spawned.
"""

from __future__ import annotations

import os
from typing import Any

from vpool.mpi import coll, errors, ftmpi, intercomm
from vpool.mpi.comm import _Core, agree_ctx
from vpool.mpi.envelope import as_rank
from vpool.mpi.handles import Info
from vpool.protocol.messages import SpawnRequest

_TRUE = ("1", "true", "yes", "on")


def least_of(soft: str | None, maxprocs: int) -> int:
    """The least process count MPI's ``soft`` info value allows (``maxprocs`` when absent):
    a comma-separated list of ``n``, ``a:b`` (a to b) and ``a:b:c`` (a to b in steps of c)."""
    if soft is None or not soft.strip():
        return maxprocs
    least: int | None = None
    try:
        for part in soft.split(","):
            fields = [int(f) for f in part.strip().split(":")]
            if not 1 <= len(fields) <= 3 or fields[0] < 0:
                raise ValueError(part)
            if len(fields) == 3 and fields[2] <= 0:
                raise ValueError(part)
            if len(fields) >= 2 and fields[1] < fields[0]:
                continue  # an empty range allows nothing
            least = fields[0] if least is None else min(least, fields[0])
    except ValueError as exc:
        raise errors.MPIException(errors.ERR_INFO_VALUE, f"soft={soft!r}") from exc
    if least is None:
        raise errors.MPIException(errors.ERR_INFO_VALUE, f"soft={soft!r} allows no count")
    return min(least, maxprocs)


def _info_get(info: Any, key: str) -> str | None:
    if info is None:
        return None
    if isinstance(info, Info):
        return None if info._null else info.Get(key)
    if isinstance(info, dict):
        value = info.get(key)
        return None if value is None else str(value)
    raise TypeError(f"expecting an MPI.Info, got {type(info).__name__}")


def _path(command: Any) -> str:
    path = os.fspath(command)
    return os.fsdecode(path) if isinstance(path, bytes) else path


def _argv(args: Any) -> list[str]:
    """``args`` as mpi4py takes it: None, a string (one argument) or a sequence."""
    if args is None:
        return []
    if isinstance(args, (str, bytes)):
        args = [args]
    return [_path(a) if isinstance(a, (bytes, os.PathLike)) else str(a) for a in args]


class Ask:
    """What the root asks for: one command, its process counts and the info keys."""

    def __init__(
        self, command: list[str], maxprocs: int, least: int, reported: bool, counts: list[int]
    ) -> None:
        self.command = command
        self.maxprocs = maxprocs
        self.least = least
        self.reported = reported
        self.counts = counts  # processes per command (``Spawn_multiple``'s errcodes)


def ask_single(command: Any, args: Any, maxprocs: Any, info: Any) -> Ask:
    maxprocs = int(maxprocs)
    if maxprocs < 1:
        raise errors.MPIException(errors.ERR_SPAWN, f"cannot start {maxprocs} processes")
    least = least_of(_info_get(info, "soft"), maxprocs)
    reported = (_info_get(info, "vpool_reported") or "").strip().lower() in _TRUE
    return Ask([_path(command), *_argv(args)], maxprocs, least, reported, [maxprocs])


def ask_multiple(commands: Any, args: Any, maxprocs: Any, info: Any) -> Ask:
    """``Spawn_multiple``'s arguments at the root (checked as mpi4py does: ``ValueError`` for
    mismatched lengths): one request."""
    if isinstance(commands, (str, bytes, os.PathLike)):
        raise ValueError("expecting a sequence of path-like")
    cmds = [_path(c) for c in commands]
    n = len(cmds)
    if args is None:
        argvs: list[Any] = [None] * n
    elif isinstance(args, (str, bytes)):
        argvs = [args] * n
    else:
        argvs = list(args)
        if len(argvs) != n:
            raise ValueError(f"expecting {n} items, got {len(argvs)}")
    if maxprocs is None or isinstance(maxprocs, int):
        counts = [1 if maxprocs is None else int(maxprocs)] * n
    else:
        counts = [int(m) for m in maxprocs]
        if len(counts) != n:
            raise ValueError(f"expecting {n} items, got {len(counts)}")
    if info is None or isinstance(info, (Info, dict)):
        infos = [info] * n
    else:
        infos = list(info)
        if len(infos) != n:
            raise ValueError(f"expecting {n} items, got {len(infos)}")
    asks = [ask_single(c, a, m, i) for c, a, m, i in zip(cmds, argvs, counts, infos, strict=True)]
    if not asks:
        raise errors.MPIException(errors.ERR_SPAWN, "no command to spawn")
    first = asks[0]
    if any(a.command != first.command or a.reported != first.reported for a in asks[1:]):
        raise NotImplementedError(
            "Spawn_multiple of different commands: vpool spawns one command per spawn (each "
            "spawn gets a COMM_WORLD of its own); spawn them one by one, or one program that "
            "picks its part by rank"
        )
    soft = any(a.least < a.maxprocs for a in asks)
    total = sum(counts)
    least = sum(a.least for a in asks) if soft else total
    return Ask(first.command, total, least, first.reported, counts)


Made = tuple[_Core | None, list[int], list[int], str]
"""A spawn's outcome: (the intercommunicator's core or None, the new ranks, the processes asked
for per command, the error)."""


def spawn(h: _Core, root: Any, make_ask: Any, replaces: bool = False) -> Made:
    """The collective part of a spawn over the intracommunicator ``h``: ``make_ask()`` is
    called at the root only (its errors raise at every member). ``replaces``: the spawn of
    FT-MPI's rebuild, which tells the children their role itself (``ftmpi``)."""
    eng = h.eng
    r = as_rank(root)
    if not 0 <= r < h.size:
        raise errors.MPIException(errors.ERR_ROOT, f"root {r} of a {h.size}-rank communicator")
    ctx = agree_ctx(h, intercomm.SPAN)
    found: Any = None
    if h.rank == r:
        found = _at_root(eng, h, ctx, make_ask)
    if h.size > 1:
        found = coll.bcast(h, found, r)
    ranks, counts, error, reported, exc = found
    if exc is not None:
        cls, text = exc
        raise (ValueError(text) if cls == "ValueError" else NotImplementedError(text))
    if error:
        return None, [], counts, error
    if reported:
        eng.watch.update(ranks)
    if eng.strict and not replaces:
        ftmpi.tell_children(eng, h, ranks)
    return _Core(eng, ctx, h.group, remote=tuple(ranks)), list(ranks), counts, ""


def _at_root(eng: Any, h: _Core, ctx: int, make_ask: Any) -> tuple[Any, ...]:
    """Ask the agent, wait for its answer: (ranks, counts, error, reported, exception)."""
    try:
        ask = make_ask()
    except errors.MPIException as exc:
        return [], [], str(exc), False, None
    except (ValueError, NotImplementedError) as exc:
        return [], [], str(exc), False, (type(exc).__name__, str(exc))
    t = eng.transport
    if t is None:
        return [], ask.counts, "this process has no agent to spawn through", False, None
    eng.spawns += 1
    seq = eng.spawns
    request = SpawnRequest(
        seq=seq,
        command=ask.command,
        maxprocs=ask.maxprocs,
        least=ask.least,
        parent=list(h.group),
        ctx=ctx,
        reported=ask.reported,
    )
    t.send_message(request)
    sock = t.sock
    while (answer := eng.answers.pop(seq, None)) is None:
        eng.block()
        t = eng.transport
        if t is None:
            return [], ask.counts, "MPI was finalized during the spawn", False, None
        if t.sock is not sock:
            # Restored from a checkpoint taken while waiting (the transport reopened on a new
            # connection): the new agent never saw the request.
            sock = t.sock
            t.send_message(request)
    if not answer.error and not answer.ranks:
        error = "no process could be started now (a soft spawn that allows none)"
    else:
        error = answer.error
    return list(answer.ranks), ask.counts, error, ask.reported, None


def errcodes_for(asked: int, started: int, error: str) -> list[int]:
    """One code per process asked for: ``SUCCESS`` for each started, ``ERR_SPAWN`` after."""
    ok = 0 if error else started
    return [errors.SUCCESS] * ok + [errors.ERR_SPAWN] * (asked - ok)


def parent_core(eng: Any, world: tuple[int, ...], parent: list[int], ctx: int) -> _Core:
    """A spawned process's intercommunicator to its parents (``Get_parent``); its own
    communicators' contexts start past it."""
    eng.next_ctx = max(eng.next_ctx, ctx + intercomm.SPAN)
    return _Core(eng, ctx, world, remote=tuple(parent))
