"""FT-MPI's blank communicators without a failure: every collective and constructor of a
communicator with holes (``vpool.mpi.blank``), against values computed in plain Python.

    blank_coll.py HOLES...     each argument one case: the COMM_WORLD ranks left as holes,
                               comma-separated (``0``, ``1,3``)

For each case the live ranks make a blank copy of COMM_WORLD (``blank.blanked``) and check on
it every collective, blocking and non-blocking, on objects and on buffers, with a hole as root
(``ERR_PROC_FAILED`` everywhere), then ``Dup``, ``Split``, ``Create``, topologies. The holes'
processes skip the case. In the last case the holes are also marked failed in the engine, as
after a real failure: the same checks run again, then point-to-point with a hole and ``Shrink``;
the holes' processes stop there. Every rank prints ``blank ok <rank> cases=<checked cases>``;
a check that fails raises.
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from vpool.mpi import environment
from vpool.mpi.blank import blanked

world = MPI.COMM_WORLD
me, n = world.Get_rank(), world.Get_size()
CASES = [frozenset(int(r) for r in arg.split(",")) for arg in sys.argv[1:]]

I8 = np.int64


def expect(got, want, what):  # type: ignore[no-untyped-def]
    if isinstance(want, np.ndarray) or isinstance(got, np.ndarray):
        ok = np.array_equal(got, want)
    else:
        ok = got == want
    if not ok:
        raise AssertionError(f"rank {me}: {what}: got {got!r}, expected {want!r}")


def fails(what, call, *args):  # type: ignore[no-untyped-def]
    """``call(*args)`` raises ERR_PROC_FAILED."""
    try:
        call(*args)
    except MPI.Exception as exc:
        expect(exc.Get_error_class(), MPI.ERR_PROC_FAILED, what)
        return
    raise AssertionError(f"rank {me}: {what}: no error")


def concat(a, b, dt):  # type: ignore[no-untyped-def]
    return a + b


CAT = MPI.Op.Create(concat, commute=False)


def run(comm, name, nb, *args):  # type: ignore[no-untyped-def]
    """Call collective ``name`` blocking, or its ``I`` form (``Bcast``: ``Ibcast``) and wait."""
    if nb:
        getattr(comm, "I" + name[0].lower() + name[1:])(*args).Wait()
    else:
        getattr(comm, name)(*args)


def check_objects(bc, holes, live):  # type: ignore[no-untyped-def]
    def spread(f):  # type: ignore[no-untyped-def]
        return [f(i) if i in live else None for i in range(n)]

    bc.barrier()
    bc.ibarrier().wait()
    letters = "".join(chr(65 + r) for r in live)
    expect(bc.allreduce(me), sum(live), "allreduce")
    expect(bc.allreduce(chr(65 + me), CAT), letters, "allreduce in rank order")
    mine = live.index(me)
    expect(bc.scan(chr(65 + me), CAT), letters[: mine + 1], "scan")
    expect(bc.exscan(chr(65 + me), CAT), letters[:mine] or None, "exscan")
    expect(bc.allgather(me * 10), spread(lambda i: i * 10), "allgather")
    expect(bc.alltoall([(me, i) for i in range(n)]), spread(lambda i: (i, me)), "alltoall")
    for root in live:
        at = me == root
        expect(bc.bcast(("b", root) if at else None, root), ("b", root), "bcast")
        expect(bc.reduce(me + 1, MPI.SUM, root), sum(live) + len(live) if at else None, "reduce")
        expect(bc.reduce(chr(65 + me), CAT, root), letters if at else None, "reduce in order")
        expect(bc.gather((me, "g"), root), spread(lambda i: (i, "g")) if at else None, "gather")
        items = [("s", i) for i in range(n)] if at else None
        expect(bc.scatter(items, root), ("s", me), "scatter")
    for root in sorted(holes):
        fails("bcast to a hole root", bc.bcast, 1, root)
        fails("reduce to a hole root", bc.reduce, 1, MPI.SUM, root)
        fails("gather to a hole root", bc.gather, 1, root)
        fails("scatter from a hole root", bc.scatter, [0] * n, root)


def v_layout(counts):  # type: ignore[no-untyped-def]
    """Displacements with a gap of one element after each block, and the buffer length."""
    displs, pos = [], 0
    for c in counts:
        displs.append(pos)
        pos += c + 1
    return displs, pos


def bogus(counts, holes):  # type: ignore[no-untyped-def]
    """The counts with the holes' replaced by nonsense: a blank communicator ignores them."""
    return [99 if i in holes else c for i, c in enumerate(counts)]


def check_buffers(bc, holes, live, nb):  # type: ignore[no-untyped-def]
    """Every buffer collective (``nb``: its non-blocking form), two elements a block."""
    tag = "I" if nb else ""
    run(bc, "Barrier", nb)
    total = np.empty(2, I8)
    run(bc, "Allreduce", nb, np.array([me, 1], I8), total, MPI.SUM)
    expect(total, np.array([sum(live), len(live)], I8), tag + "Allreduce")
    for root in live:
        at = me == root
        buf = np.arange(3, dtype=I8) + 100 * root if at else np.zeros(3, I8)
        run(bc, "Bcast", nb, buf, root)
        expect(buf, np.arange(3, dtype=I8) + 100 * root, tag + "Bcast")
        out = np.full(2, -1, I8)
        run(bc, "Reduce", nb, np.array([me, 1], I8), out, MPI.SUM, root)
        want = np.array([sum(live), len(live)], I8) if at else np.full(2, -1, I8)
        expect(out, want, tag + "Reduce")
        # Gather: the holes' blocks stay as they were (-1); once in place at the root.
        recv = np.full(2 * n, -1, I8)
        if at:
            recv[2 * me : 2 * me + 2] = me + 1
        send = MPI.IN_PLACE if at and root % 2 else np.full(2, me + 1, I8)
        run(bc, "Gather", nb, send, recv, root)
        want = np.repeat([i + 1 if i in live else -1 for i in range(n)], 2).astype(I8)
        expect(recv, want if at else np.full(2 * n, -1, I8), tag + "Gather")
        counts = [i + 1 for i in range(n)]
        displs, length = v_layout(counts)
        recv = np.full(length, -1, I8)
        run(
            bc,
            "Gatherv",
            nb,
            np.full(me + 1, me + 1, I8),
            [recv, bogus(counts, holes), displs, MPI.INT64_T],
            root,
        )
        want = np.full(length, -1, I8)
        if at:
            for i in live:
                want[displs[i] : displs[i] + counts[i]] = i + 1
        expect(recv, want, tag + "Gatherv")
        send = np.repeat(np.arange(n, dtype=I8) * 10, 2) + np.tile([0, 1], n).astype(I8)
        out = np.full(2, -1, I8)
        run(bc, "Scatter", nb, send if at else None, out, root)
        expect(out, np.array([10 * me, 10 * me + 1], I8), tag + "Scatter")
        send = np.full(length, -7, I8)
        for i in range(n):
            send[displs[i] : displs[i] + counts[i]] = i
        out = np.full(me + 1, -1, I8)
        spec = [send, bogus(counts, holes), displs, MPI.INT64_T] if at else None
        run(bc, "Scatterv", nb, spec, out, root)
        expect(out, np.full(me + 1, me, I8), tag + "Scatterv")
    for root in sorted(holes):
        buf = np.zeros(2, I8)
        fails(tag + "Bcast from a hole", run, bc, "Bcast", nb, buf, root)
        fails(tag + "Reduce to a hole", run, bc, "Reduce", nb, buf, buf, MPI.SUM, root)
        fails(tag + "Gather to a hole", run, bc, "Gather", nb, buf, buf, root)
        fails(tag + "Gatherv to a hole", run, bc, "Gatherv", nb, buf, [buf, [0] * n], root)
        fails(tag + "Scatter from a hole", run, bc, "Scatter", nb, None, buf, root)
        fails(tag + "Scatterv from a hole", run, bc, "Scatterv", nb, None, buf, root)
    # Allgather, not in place and in place.
    block = [i + 1 if i in live else -1 for i in range(n)]
    for in_place in (False, True):
        recv = np.full(2 * n, -1, I8)
        send = np.full(2, me + 1, I8)
        if in_place:
            recv[2 * me : 2 * me + 2] = send
        run(bc, "Allgather", nb, MPI.IN_PLACE if in_place else send, recv)
        expect(recv, np.repeat(block, 2).astype(I8), f"{tag}Allgather in place={in_place}")
    counts = [i + 1 for i in range(n)]
    displs, length = v_layout(counts)
    recv = np.full(length, -1, I8)
    run(
        bc,
        "Allgatherv",
        nb,
        np.full(me + 1, me + 1, I8),
        [recv, bogus(counts, holes), displs, MPI.INT64_T],
    )
    want = np.full(length, -1, I8)
    for i in live:
        want[displs[i] : displs[i] + counts[i]] = i + 1
    expect(recv, want, tag + "Allgatherv")
    # Alltoall: rank r's block for rank i holds 100 r + i.
    for in_place in (False, True):
        send = np.repeat(100 * me + np.arange(n, dtype=I8), 2)
        recv = send.copy() if in_place else np.full(2 * n, -1, I8)
        run(bc, "Alltoall", nb, MPI.IN_PLACE if in_place else send, recv)
        want = np.repeat(
            [100 * i + me if i in live else (100 * me + i if in_place else -1) for i in range(n)], 2
        ).astype(I8)
        expect(recv, want, f"{tag}Alltoall in place={in_place}")
    # Alltoallv: i + 1 elements to rank i (100 r + i each), with gaps.
    sdispls, slen = v_layout(counts)
    send = np.full(slen, -7, I8)
    for i in range(n):
        send[sdispls[i] : sdispls[i] + counts[i]] = 100 * me + i
    rcounts = [me + 1] * n
    rdispls, rlen = v_layout(rcounts)
    recv = np.full(rlen, -1, I8)
    run(
        bc,
        "Alltoallv",
        nb,
        [send, bogus(counts, holes), sdispls, MPI.INT64_T],
        [recv, bogus(rcounts, holes), rdispls, MPI.INT64_T],
    )
    want = np.full(rlen, -1, I8)
    for i in live:
        want[rdispls[i] : rdispls[i] + me + 1] = 100 * i + me
    expect(recv, want, tag + "Alltoallv")
    # Alltoallw: one int64 each way at byte displacements.
    send = 100 * me + np.arange(n, dtype=I8)
    recv = np.full(n, -1, I8)
    offsets = [8 * i for i in range(n)]
    types = [MPI.INT64_T] * n
    run(bc, "Alltoallw", nb, [send, [1] * n, offsets, types], [recv, [1] * n, offsets, types])
    expect(
        recv, np.array([100 * i + me if i in live else -1 for i in range(n)], I8), tag + "Alltoallw"
    )
    # Reduce_scatter_block: block i of rank r's buffer is [2 i + r, 2 i + 1 + r].
    want = np.array([2 * me * len(live) + sum(live), (2 * me + 1) * len(live) + sum(live)], I8)
    for in_place in (False, True):
        send = np.arange(2 * n, dtype=I8) + me
        out = send if in_place else np.full(2, -1, I8)
        run(bc, "Reduce_scatter_block", nb, MPI.IN_PLACE if in_place else send, out, MPI.SUM)
        expect(out[:2], want, f"{tag}Reduce_scatter_block in place={in_place}")
    # Reduce_scatter: rank i gets i + 1 elements (holes' blocks reduced for no one).
    starts = [sum(counts[:i]) for i in range(n)]
    send = np.arange(sum(counts), dtype=I8) * (me + 1)
    out = np.full(me + 1, -1, I8)
    run(bc, "Reduce_scatter", nb, send, out, counts, MPI.SUM)
    weight = sum(r + 1 for r in live)
    expect(
        out, np.arange(starts[me], starts[me] + me + 1, dtype=I8) * weight, tag + "Reduce_scatter"
    )
    if not nb:  # counts from the receive buffers: a hole counts for nothing
        live_counts = [i + 1 if i in live else 0 for i in range(n)]
        lstarts = [sum(live_counts[:i]) for i in range(n)]
        send = np.arange(sum(live_counts), dtype=I8) * (me + 1)
        out = np.full(me + 1, -1, I8)
        bc.Reduce_scatter(send, out, None, MPI.SUM)
        want = np.arange(lstarts[me], lstarts[me] + me + 1, dtype=I8) * weight
        expect(out, want, "Reduce_scatter without counts")
    # Scan, Exscan: over the live members in rank order; the first one's Exscan is untouched.
    out = np.full(1, -1, I8)
    run(bc, "Scan", nb, np.array([me + 1], I8), out, MPI.SUM)
    expect(out[0], sum(r + 1 for r in live if r <= me), tag + "Scan")
    out = np.full(1, -1, I8)
    run(bc, "Exscan", nb, np.array([me + 1], I8), out, MPI.SUM)
    want_ex = sum(r + 1 for r in live if r < me) if me != live[0] else -1
    expect(out[0], want_ex, tag + "Exscan")


def check_constructors(bc, holes, live):  # type: ignore[no-untyped-def]
    expect((bc.Get_size(), bc.Get_rank()), (n, me), "size and rank")
    expect(bc.Get_group().Get_size(), n, "group size (holes included)")
    for made in (bc.Dup(), bc.Idup()[0], bc.Clone()):
        expect((made.Get_size(), made.Get_rank()), (n, me), "Dup size and rank")
        expect(bc.Compare(made), MPI.CONGRUENT, "Dup compares congruent")
        expect(made.allgather(me), [i if i in live else None for i in range(n)], "Dup's holes")
        made.Free()
    # Split: colors by parity, keys reversed; holes are in no part.
    part = bc.Split(me % 2, -me)
    mates = [r for r in reversed(live) if r % 2 == me % 2]
    expect((part.Get_size(), part.Get_rank()), (len(mates), mates.index(me)), "Split")
    expect(part.allgather(me), mates, "Split's members")
    part.Free()
    none = bc.Split(MPI.UNDEFINED if me == live[0] else 0)
    expect(none == MPI.COMM_NULL, me == live[0], "Split UNDEFINED")
    if none != MPI.COMM_NULL:
        none.Free()
    shared = bc.Split_type(MPI.COMM_TYPE_SHARED)
    expect(shared.allgather(me), live, "Split_type")
    shared.Free()
    for made in (bc.Create(bc.Get_group()), bc.Create_group(bc.Get_group())):
        expect(made.allgather(me), live, "Create over a group with holes")
        made.Free()
    # Topologies: over the first ranks if no hole is among them, never over a hole.
    fails("a Cartesian topology over holes", bc.Create_cart, [n])
    ring = [(i + 1) % n for i in range(n)]
    fails("a graph over holes", bc.Create_graph, list(range(1, n + 1)), ring)
    fails("a distributed graph over holes", bc.Create_dist_graph_adjacent, [], [])
    first = min(holes)
    if first:
        cart = bc.Create_cart([first])
        expect(cart == MPI.COMM_NULL, me >= first, "Cartesian topology before the first hole")
        if cart != MPI.COMM_NULL:
            expect(cart.allgather(me), list(range(first)), "Cartesian members")
            cart.Free()
    expect(bc.allreduce(1), len(live), "still in step")


def check_failed(bc, holes, live):  # type: ignore[no-untyped-def]
    """Holes that are failed ranks in the engine, as after a real failure."""
    hole = min(holes)
    fails("Send to a hole", bc.Send, np.zeros(1, I8), hole)
    fails("Recv from a hole", bc.Recv, np.zeros(1, I8), hole)
    mine = live.index(me)
    right, left = live[(mine + 1) % len(live)], live[mine - 1]
    got = bc.sendrecv(("p2p", me), right, 5, source=left, recvtag=5)
    expect(got, ("p2p", left), "p2p between live members")
    expect(bc.Agree(0xFF & ~(1 << me)), 0xFF & ~sum(1 << r for r in live), "Agree")
    shrunk = bc.Shrink()
    expect((shrunk.Get_size(), shrunk.Get_rank()), (len(live), mine), "Shrink")
    expect(shrunk.allgather(me), live, "Shrink's members")
    shrunk.Free()


checked = []
for k, holes in enumerate(CASES):
    last = k == len(CASES) - 1
    if me in holes:
        if last:
            break
        continue
    live = [r for r in range(n) if r not in holes]
    bc = blanked(world, holes)
    if last:
        environment.engine().apply_failed(sorted(holes))
    check_objects(bc, holes, live)
    for nb in (False, True):
        check_buffers(bc, holes, live, nb)
    check_constructors(bc, holes, live)
    if last:
        check_failed(bc, holes, live)
    bc.Free()
    checked.append(str(k))

print(f"blank ok {me} cases={','.join(checked)}", flush=True)
