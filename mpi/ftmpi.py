"""FT-MPI's failure modes on top of ULFM (seed 003): blank, shrink and rebuild.

FT-MPI (Fagg and Dongarra) let the application choose what a failure does to ``MPI_COMM_WORLD``;
a job chooses it with ``--on-failure``:

- **blank**: the world keeps its size and every survivor its rank; the failed ranks are holes
  (``blank``: point-to-point with a hole raises ``ERR_PROC_FAILED``, collectives skip them);
- **shrink**: the failed ranks leave; the survivors close up, in order;
- **rebuild**: a new process, started fresh, takes each failed rank's place and number.

The rules, as in FT-MPI:

1. *Detected.* A failure is reported as in ``ulfm`` (the agent's ``Failed``); in these modes it
   also breaks every communicator it is a member of (``Engine.strict``): every pending and later
   operation on one fails with ``ERR_PROC_FAILED``, not only those naming the failed rank, so
   that every survivor reaches its recovery code instead of waiting for one that did.
2. *Recovery.* The program calls ``MPI.COMM_WORLD.Dup()`` (FT-MPI's ``MPI_Comm_dup`` of
   ``MPI_COMM_WORLD``; ``recover``). The survivors agree on the failed set (ULFM's fault-tolerant
   agreement, ``ulfm.agreement``, which also picks a context id free at all of them),
   ``MPI.COMM_WORLD`` itself is rebuilt by the mode, in place, and the call returns a duplicate
   of the rebuilt world. Communicators made before stay broken: the program makes them again
   from the world. The rebuilt world has fresh context ids, so messages of the old one in
   flight never match in it (FT-MPI's RESET communication mode).
3. *Rebuild.* The survivors spawn the replacements (``spawn.spawn`` over the shrunk world: the
   pool starts them as any spawn, so they count against the job's spawn allowance) running the
   program with this process's own command line, and agree (again ULFM's agreement) that the
   spawn went through at every one of them, so that a failure during it cannot leave some in
   the new world and others in the old (if it did not, the root tells the new processes to
   end, "drop", and the recovery raises ``ERR_PROC_FAILED``); the root then tells each its place
   (``CTX_REBUILD``: the rebuilt world's ranks and context id). A replacement reads that at
   ``MPI.Init`` (``join``), before the program runs, and installs the rebuilt world as its
   ``COMM_WORLD``; its ``MPI.Comm.Get_parent()`` is the intercommunicator to the survivors, which
   is how the program knows it is a replacement (as in ULFM's respawn examples). It then calls
   ``MPI.COMM_WORLD.Dup()`` too, meeting the survivors' duplicate of the rebuilt world. Every
   spawn of a rebuild job tells its children their role, so that an ordinary spawn's children
   are not left waiting for one (``tell_children``).

A failure during a recovery fails it with ``ERR_PROC_FAILED`` like any operation; the program
calls ``Dup`` again, which recovers from both. A replacement whose root failed before telling it
its place ends at once, with code 0 and a line on stderr: the next recovery starts another.
"""

from __future__ import annotations

import sys
from typing import Any

import msgspec

from vpool.mpi import errors
from vpool.mpi.comm import _Core
from vpool.mpi.constants import UNDEFINED
from vpool.mpi.request import RecvOp
from vpool.mpi.runtime import CTX_REBUILD
from vpool.mpi.sched import run
from vpool.protocol.messages import KIND_BUFFER

FT_MODES = frozenset({"blank", "shrink", "rebuild"})

_encode = msgspec.msgpack.encode
_decode = msgspec.msgpack.decode


def mode(eng: Any) -> str:
    t = eng.transport
    return str(t.on_failure) if t is not None else "transparent"


def _world() -> Any:
    from vpool.mpi import environment

    return environment.COMM_WORLD


def recovering(h: Any) -> bool:
    """Whether a ``Dup`` of ``h`` is FT-MPI's recovery: ``h`` is COMM_WORLD, broken by a
    failure of one of its members (a blank world's holes do not break it)."""
    eng = h.eng
    if h is not _world()._h:
        return False
    return eng.broken_by(h.ctx, h.w2c, eng.failed) is not None


def recover(comm: Any) -> Any:
    """FT-MPI's recovery (module docstring, 2 and 3): rebuild COMM_WORLD, return its dup."""
    from vpool.mpi import blank, ulfm

    h = comm._core()
    eng = h.eng
    how = mode(eng)
    state = run(h, ulfm.agreement(h, 0), tolerant=True)
    # What the survivors agreed on, learnt here too if the agent had not said it yet.
    eng.apply_failed([w for w in h.group if w in state.known and w not in eng.failed_set])
    lost = [w for w in h.group if w in state.known and w not in h.holes]
    survivors = tuple(w for w in h.group if w not in state.known)
    ctx = state.next_ctx
    eng.next_ctx = max(eng.next_ctx, ctx + 2)
    if how == "blank":
        core = blank.blank_core(eng, ctx, h.group, h.holes | frozenset(lost))
    elif how == "rebuild" and lost:
        core = _rebuilt(h, ctx, survivors, lost)
    else:
        core = _Core(eng, ctx, survivors)
    install(eng, core, h)
    return comm.Dup()


def _rebuilt(h: Any, ctx: int, survivors: tuple[int, ...], lost: list[int]) -> _Core:
    """Rebuild's world (module docstring, 3): spawn the replacements over the survivors, then
    agree that the spawn went through at every survivor before anyone installs the new world.
    A failure during the spawn may stop it at some survivors and not others; without that
    second agreement they would go on in different worlds. When it did not go through, the
    root tells the processes it started that they are not needed, and the recovery raises
    ``ERR_PROC_FAILED`` everywhere (``Dup`` again recovers from both failures)."""
    from vpool.mpi import spawn, ulfm

    eng = h.eng
    shrunk = _Core(eng, ctx, survivors)
    shrunk.errh = h.errh
    command = [sys.executable, *sys.orig_argv[1:]]
    k = len(lost)
    ranks: list[int] = []
    error = ""
    try:
        inter, ranks, _, error = spawn.spawn(
            shrunk, 0, lambda: spawn.Ask(command, k, k, False, [k]), replaces=True
        )
        done = inter is not None
    except errors.MPIException:
        done = False
    state = run(shrunk, ulfm.agreement(shrunk, int(done)), tolerant=True)
    if not state.flags.get(0, 0):
        if shrunk.rank == 0 and ranks:
            _tell(eng, ranks, "drop")
        if error:
            raise errors.MPIException(
                errors.ERR_SPAWN, f"cannot start processes in place of the lost ranks: {error}"
            )
        raise errors.MPIException(
            errors.ERR_PROC_FAILED,
            "another rank failed during the recovery: call MPI.COMM_WORLD.Dup() again",
        )
    wctx = state.next_ctx  # free at every survivor, as the agreement says
    eng.next_ctx = max(eng.next_ctx, wctx + 2)
    fresh = dict(zip(lost, ranks, strict=True))
    group = tuple(fresh.get(w, w) for w in h.group)
    if shrunk.rank == 0:
        _tell(eng, ranks, [list(group), wctx])
    return _Core(eng, wctx, group)


def _tell(eng: Any, ranks: list[int], role: Any) -> None:
    """Tell spawned processes their role (``join``): None (an ordinary spawn), "drop" (a
    rebuild that did not go through) or the rebuilt world's ranks and context id."""
    payload = _encode(role)
    for r in ranks:
        eng.send_quiet(r, CTX_REBUILD, 0, KIND_BUFFER, [], [payload], len(payload))


def install(eng: Any, core: _Core, old: _Core) -> None:
    """Make ``core`` the process's COMM_WORLD (the same ``MPI.COMM_WORLD`` object), with the
    error handler and attributes of the ``old`` one."""
    core.name = "MPI_COMM_WORLD"
    core.errh = old.errh
    core.attrs = old.attrs
    eng.world = core.group
    _world()._h = core


def tell_children(eng: Any, h: Any, ranks: list[int]) -> None:
    """Rebuild jobs: the root of an ordinary spawn tells its children they replace nobody."""
    if h.rank == 0 and mode(eng) == "rebuild":
        _tell(eng, ranks, None)


def join(eng: Any, parent: list[int]) -> None:
    """At ``MPI.Init`` of a spawned process of a rebuild job: its role, from the spawn's
    root (module docstring, 3). A replacement takes the rebuilt world as COMM_WORLD."""
    op = RecvOp(CTX_REBUILD, parent[0], 0, None, [UNDEFINED] * eng.size)
    eng.post(op)
    if not op.done:
        eng.wait(op)
    role = "drop" if op.error else _decode(bytes(op.payload))
    if role == "drop":
        # The recovery that started it did not go through (or its root failed before telling
        # it): the survivors start others in the next one. Nothing to do here: end quietly.
        print(
            "vpool: this process was started to replace a lost rank, but the recovery that "
            "started it was interrupted by another failure; it ends (the next one starts "
            "another)",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(0)
    if role is None:
        return
    group, wctx = role
    eng.next_ctx = max(eng.next_ctx, int(wctx) + 2)
    install(eng, _Core(eng, int(wctx), tuple(int(w) for w in group)), _world()._h)
