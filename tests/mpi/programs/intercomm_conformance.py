"""Intercommunicators checked on every rank (run by test_intercomm.py): construction, point to
point naming the remote group, the collectives with MPI's ROOT/PROC_NULL roots (objects and
buffers, blocking, non-blocking and persistent), management (Dup, Split, Create, Merge,
Create_from_groups, Disconnect) and mpi4py.futures' comm_split pattern.

Each check runs over several splits of the world (halves, rank 0 against the rest, odd against
even ranks with a leader that is not rank 0). Prints ``intercomm ok N`` on rank 0 when every
check passed at every rank.
"""

from array import array

from mpi4py import MPI

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()
WORLD_GROUP = world.Get_group()


def world_ranks(group):
    return group.Translate_ranks(None, WORLD_GROUP)


def halves(r):
    return 0 if r < size // 2 else 1


def first_alone(r):
    return 0 if r == 0 else 1


def odd_even(r):
    return r % 2


SPLITS = [halves, first_alone, odd_even]


class Inter:
    """An intercommunicator of the world split by ``color_of``, and what it should be."""

    def __init__(self, color_of, last_leader=False):
        self.color = color_of(rank)
        self.mine = [r for r in range(size) if color_of(r) == self.color]
        self.theirs = [r for r in range(size) if color_of(r) != self.color]
        self.intra = world.Split(self.color, key=rank)
        # With ``last_leader`` the odd group's leader is its last member.
        odd_leader = self.color == 1 and last_leader
        their_leader = self.theirs[-1] if (self.color == 0 and last_leader) else self.theirs[0]
        local_leader = len(self.mine) - 1 if odd_leader else 0
        self.ic = self.intra.Create_intercomm(local_leader, world, their_leader, tag=11)
        self.lrank = self.mine.index(rank)

    def free(self):
        self.ic.Free()
        self.intra.Free()


def check_identity(x):
    ic = x.ic
    assert type(ic) is MPI.Intercomm
    assert ic.Is_inter() and ic.is_inter and not ic.Is_intra()
    assert ic.Get_size() == len(x.mine) and ic.size == len(x.mine)
    assert ic.Get_rank() == x.lrank == ic.rank
    assert ic.Get_remote_size() == len(x.theirs) == ic.remote_size
    assert world_ranks(ic.Get_group()) == x.mine
    assert world_ranks(ic.Get_remote_group()) == x.theirs
    assert world_ranks(ic.remote_group) == x.theirs
    assert type(MPI.Comm.fromint(ic.toint())) is MPI.Intercomm
    assert MPI.Comm.f2py(ic.py2f()) == ic
    for make, arg in ((MPI.Intracomm, ic), (MPI.Intercomm, x.intra), (MPI.Cartcomm, ic)):
        try:
            make(arg)
        except TypeError:
            pass
        else:
            raise AssertionError(f"{make.__name__}({arg}) made")
    assert MPI.Comm(ic).Is_inter()
    assert ic.Compare(ic) == MPI.IDENT
    assert ic.Compare(x.intra) == MPI.UNEQUAL
    assert not hasattr(ic, "Scan") and not hasattr(ic, "exscan")
    ic.Set_name("inter")
    assert ic.Get_name() == "inter"
    key = MPI.Comm.Create_keyval()
    ic.Set_attr(key, ("attr", rank))
    assert ic.Get_attr(key) == ("attr", rank)
    assert ic.Get_attr(MPI.TAG_UB) >= 32767
    ic.Set_errhandler(MPI.ERRORS_RETURN)
    assert ic.Get_errhandler() == MPI.ERRORS_RETURN


def expect_error(error_class, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except MPI.Exception as exc:
        assert exc.Get_error_class() == error_class, (exc.Get_error_class(), error_class)
    else:
        raise AssertionError(f"{fn.__name__} did not fail")


def check_p2p(x):
    ic, n = x.ic, len(x.theirs)
    status = MPI.Status()
    # Objects: every member to every remote one; ranks and sources name the remote group.
    for i in range(n):
        ic.send(("obj", rank, i), dest=i, tag=7)
    for j in range(n):
        got = ic.recv(source=j, tag=7, status=status)
        assert got == ("obj", x.theirs[j], x.lrank), got
        assert status.Get_source() == j and status.Get_tag() == 7
    # ANY_SOURCE: the sources come back as remote ranks.
    for i in range(n):
        ic.send(rank, dest=i, tag=8)
    seen = set()
    for _ in range(n):
        got = ic.recv(source=MPI.ANY_SOURCE, tag=8, status=status)
        assert got == x.theirs[status.source], (got, status.source)
        seen.add(status.source)
    assert seen == set(range(n))
    # Buffers, every sending mode.
    reqs = [ic.Isend(array("i", [rank, i]), dest=i, tag=1) for i in range(n)]
    reqs += [ic.Issend(array("i", [rank, -i]), dest=i, tag=2) for i in range(n)]
    for i in range(n):
        ic.Bsend(array("i", [rank, i * 10]), dest=i, tag=3)
        ic.Rsend(array("i", [rank, i * 100]), dest=i, tag=4)
    for j in range(n):
        for tag, scale in ((1, 1), (2, -1), (3, 10), (4, 100)):
            buf = array("i", [0, 0])
            ic.Recv(buf, source=j, tag=tag, status=status)
            assert list(buf) == [x.theirs[j], scale * x.lrank], (tag, list(buf))
            assert status.source == j
    MPI.Request.Waitall(reqs)
    # Synchronous objects: all started before any receive.
    reqs = [ic.issend(("sync", rank), dest=i, tag=5) for i in range(n)]
    got = [ic.recv(source=j, tag=5) for j in range(n)]
    assert got == [("sync", w) for w in x.theirs]
    MPI.Request.Waitall(reqs)
    # Sendrecv, Sendrecv_replace, Isendrecv.
    for i in range(n):
        out = array("d", [0.0])
        ic.Sendrecv(array("d", [rank + 0.5]), dest=i, sendtag=6, recvbuf=out, source=i, recvtag=6)
        assert out[0] == x.theirs[i] + 0.5
        buf = array("i", [rank])
        ic.Sendrecv_replace(buf, dest=i, sendtag=9, source=i, recvtag=9)
        assert buf[0] == x.theirs[i]
        assert ic.sendrecv(rank, dest=i, sendtag=10, source=i, recvtag=10) == x.theirs[i]
    # Probes and matched probes.
    for i in range(n):
        ic.send(("probe", rank), dest=i, tag=12)
        ic.send(("mprobe", rank), dest=i, tag=13)
    for j in range(n):
        ic.Probe(source=j, tag=12, status=status)
        assert status.source == j
        assert ic.recv(source=j, tag=12) == ("probe", x.theirs[j])
        msg = ic.mprobe(source=j, tag=13, status=status)
        assert status.source == j
        assert msg.recv() == ("mprobe", x.theirs[j])
    for i in range(n):
        ic.send(("iprobe", rank), dest=i, tag=14)
    for _ in range(n):
        while not ic.iprobe(source=MPI.ANY_SOURCE, tag=14, status=status):
            pass
        src = status.source
        assert ic.recv(source=src, tag=14) == ("iprobe", x.theirs[src])
    for i in range(n):
        ic.send(("improbe", rank), dest=i, tag=15)
    for j in range(n):
        msg = None
        while msg is None:
            msg = ic.improbe(source=j, tag=15)
        assert msg.recv() == ("improbe", x.theirs[j])
    # PROC_NULL and ranks out of the remote group.
    ic.send("lost", dest=MPI.PROC_NULL)
    assert ic.recv(source=MPI.PROC_NULL) is None
    expect_error(MPI.ERR_RANK, ic.send, "x", dest=n)
    expect_error(MPI.ERR_RANK, ic.Recv, array("i", [0]), source=n)


def roots(x, fn):
    """Run ``fn(root_arg, root_group)`` for every root of both groups, as MPI's convention says:
    ROOT at the root, PROC_NULL at the rest of its group, its remote rank in the other."""
    for group in (0, 1):
        members = x.mine if x.color == group else x.theirs
        for r in range(len(members)):
            if x.color == group:
                fn(MPI.ROOT if r == x.lrank else MPI.PROC_NULL, members[r])
            else:
                fn(r, members[r])


def check_collectives_objects(x):
    ic = x.ic
    ic.barrier()
    ic.Barrier()

    def bcast(root, root_world):
        got = ic.bcast(("b", rank) if root == MPI.ROOT else None, root=root)
        assert got == (None if root in (MPI.ROOT, MPI.PROC_NULL) else ("b", root_world)), got

    def gather(root, root_world):
        got = ic.gather(("g", rank), root=root)
        assert got == ([("g", w) for w in x.theirs] if root == MPI.ROOT else None), got

    def scatter(root, root_world):
        items = [("s", rank, i) for i in range(len(x.theirs))] if root == MPI.ROOT else None
        got = ic.scatter(items, root=root)
        want = None if root in (MPI.ROOT, MPI.PROC_NULL) else ("s", root_world, x.lrank)
        assert got == want, got

    def reduce(root, root_world):
        # List concatenation is not commutative: the remote group's values in rank order.
        got = ic.reduce([rank], op=MPI.SUM, root=root)
        assert got == (x.theirs if root == MPI.ROOT else None), got

    for fn in (bcast, gather, scatter, reduce):
        roots(x, fn)
    assert ic.allreduce([rank], op=MPI.SUM) == x.theirs
    assert ic.allreduce(rank, op=MPI.MAX) == max(x.theirs)
    assert ic.allgather(rank) == x.theirs
    got = ic.alltoall([(rank, i) for i in range(len(x.theirs))])
    assert got == [(w, x.lrank) for w in x.theirs], got
    for bad in (-2, len(x.theirs)):
        expect_error(MPI.ERR_ROOT, ic.bcast, None, root=bad)


def filled(n, value, code="i"):
    return array(code, [value] * n)


def check_collectives_buffers(x, nb, persistent):
    ic, lsize, rsize = x.ic, len(x.mine), len(x.theirs)
    me = x.lrank

    def call(name, *args, **kwargs):
        if persistent:
            req = getattr(ic, name + "_init")(*args, **kwargs)
            req.Start()
            req.Wait()
            req.Free()
        elif nb:
            getattr(ic, "I" + name.lower())(*args, **kwargs).Wait()
        else:
            getattr(ic, name)(*args, **kwargs)

    call("Barrier")

    def bcast(root, root_world):
        buf = filled(3, root_world if root == MPI.ROOT else -1)
        call("Bcast", buf, root=root)
        want = -1 if root == MPI.PROC_NULL else root_world
        assert list(buf) == [want] * 3 or root == MPI.ROOT, list(buf)

    def reduce(root, root_world):
        out = filled(2, -1)
        call("Reduce", array("i", [rank, 1]), out, op=MPI.SUM, root=root)
        if root == MPI.ROOT:
            assert list(out) == [sum(x.theirs), rsize], list(out)

    def gather(root, root_world):
        out = filled(2 * rsize, -1)
        call("Gather", array("i", [rank, rank * 2]), out, root=root)
        if root == MPI.ROOT:
            assert list(out) == [v for w in x.theirs for v in (w, w * 2)], list(out)
        counts = [w % 3 for w in x.theirs]
        vout = filled(sum(counts) + 1, -1)
        displs = [sum(counts[:i]) + 1 for i in range(rsize)]
        call("Gatherv", filled(rank % 3, rank), [vout, (counts, displs), MPI.INT], root=root)
        if root == MPI.ROOT:
            assert list(vout) == [-1] + [w for w in x.theirs for _ in range(w % 3)], list(vout)

    def scatter(root, root_world):
        out = filled(2, -1)
        send = array("i", [v for i in range(rsize) for v in (rank, i)])
        call("Scatter", send if root == MPI.ROOT else None, out, root=root)
        if root not in (MPI.ROOT, MPI.PROC_NULL):
            assert list(out) == [root_world, me], list(out)
        counts = [i + 1 for i in range(rsize)]
        displs = [sum(counts[:i]) for i in range(rsize)]
        vsend = array("i", [i for i in range(rsize) for _ in range(i + 1)])
        vout = filled(me + 1, -1)
        spec = [vsend, (counts, displs), MPI.INT] if root == MPI.ROOT else None
        call("Scatterv", spec, vout, root=root)
        if root not in (MPI.ROOT, MPI.PROC_NULL):
            assert list(vout) == [me] * (me + 1), list(vout)

    for fn in (bcast, reduce, gather, scatter):
        roots(x, fn)

    out = filled(2, -1)
    call("Allreduce", array("i", [rank, 1]), out, op=MPI.SUM)
    assert list(out) == [sum(x.theirs), rsize]
    flags = bytearray([0])
    call("Allreduce", bytearray([1]), flags, op=MPI.LAND)
    assert flags[0] == 1
    out = filled(rsize, -1)
    call("Allgather", array("i", [rank]), out)
    assert list(out) == x.theirs, list(out)
    counts = [w % 3 + 1 for w in x.theirs]
    displs = [sum(counts[:i]) for i in range(rsize)]
    vout = filled(sum(counts), -1)
    call("Allgatherv", filled(rank % 3 + 1, rank), [vout, (counts, displs), MPI.INT])
    assert list(vout) == [w for w in x.theirs for _ in range(w % 3 + 1)], list(vout)
    out = filled(2 * rsize, -1)
    call("Alltoall", array("i", [v for i in range(rsize) for v in (rank, i)]), out)
    assert list(out) == [v for w in x.theirs for v in (w, me)], list(out)
    # Alltoallv: remote rank i gets i + 1 copies of this rank's world rank.
    scounts = [i + 1 for i in range(rsize)]
    sdispls = [sum(scounts[:i]) for i in range(rsize)]
    send = array("i", [rank for i in range(rsize) for _ in range(i + 1)])
    rcounts = [me + 1] * rsize
    rdispls = [i * (me + 1) for i in range(rsize)]
    out = filled(rsize * (me + 1), -1)
    call("Alltoallv", [send, (scounts, sdispls), MPI.INT], [out, (rcounts, rdispls), MPI.INT])
    assert list(out) == [w for w in x.theirs for _ in range(me + 1)], list(out)
    # Alltoallw: a double to every remote rank, byte displacements.
    send = array("d", [rank + 0.25] * rsize)
    out = array("d", [-1.0] * rsize)
    displs = [8 * i for i in range(rsize)]
    call(
        "Alltoallw",
        [send, ([1] * rsize, displs), [MPI.DOUBLE] * rsize],
        [out, ([1] * rsize, displs), [MPI.DOUBLE] * rsize],
    )
    assert list(out) == [w + 0.25 for w in x.theirs], list(out)
    # Reduce_scatter(_block): the remote group's sums, scattered over this group. Both groups
    # reduce vectors of the same length (MPI's rule): lcm-free, lsize * rsize items.
    total = lsize * rsize
    out = filled(rsize, -1)
    call("Reduce_scatter_block", array("i", [rank * 1000 + k for k in range(total)]), out, MPI.SUM)
    want = [sum(w * 1000 for w in x.theirs) + len(x.theirs) * k for k in range(total)]
    assert list(out) == want[me * rsize : (me + 1) * rsize], list(out)
    counts = [rsize] * lsize
    counts[0] += 1
    counts[-1] -= 1
    out = filled(counts[me], -1)
    call("Reduce_scatter", array("i", [rank] * total), out, counts, MPI.SUM)
    assert list(out) == [sum(x.theirs)] * counts[me], list(out)


def check_overlap(x):
    """Non-blocking collectives in flight at once, waited on in reverse, with a pending
    ANY_SOURCE/ANY_TAG receive that must get the point-to-point message, not theirs."""
    ic = x.ic
    pending = ic.irecv(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
    buf = array("i", [rank if x.color == 0 and x.lrank == 0 else -1])
    if x.color == 0:
        bcast = ic.Ibcast(buf, root=MPI.ROOT if x.lrank == 0 else MPI.PROC_NULL)
    else:
        bcast = ic.Ibcast(buf, root=0)
    out = array("i", [-1])
    allreduce = ic.Iallreduce(array("i", [rank]), out, op=MPI.MAX)
    barrier = ic.Ibarrier()
    MPI.Request.Waitall([barrier, allreduce, bcast])
    assert out[0] == max(x.theirs)
    if x.color == 1:
        assert buf[0] == x.theirs[0]
    for i in range(len(x.theirs)):
        ic.send(("p2p", rank), dest=i, tag=77)
    got = [pending.wait()] + [ic.recv(source=MPI.ANY_SOURCE, tag=77) for _ in x.theirs[1:]]
    assert sorted(got) == [("p2p", w) for w in x.theirs], got


def check_management(x):
    ic = x.ic
    # Dup, Idup, Clone: both groups agree, and the copies work.
    dup = ic.Dup()
    assert type(dup) is MPI.Intercomm and dup.Compare(ic) == MPI.CONGRUENT
    assert dup.allgather(rank) == x.theirs
    idup, req = ic.Idup()
    req.Wait()
    clone = ic.Clone()
    assert idup.allreduce(1) == len(x.theirs) and clone.allreduce(2) == 2 * len(x.theirs)
    # Split: color by parity of the local rank, keys reversing the order.
    color = x.lrank % 2
    sub = ic.Split(color, key=-x.lrank)
    mine = [w for i, w in enumerate(x.mine) if i % 2 == color][::-1]
    theirs = [w for i, w in enumerate(x.theirs) if i % 2 == color][::-1]
    if theirs:
        assert type(sub) is MPI.Intercomm
        assert world_ranks(sub.Get_group()) == mine
        assert world_ranks(sub.Get_remote_group()) == theirs
        assert sub.allgather(rank) == theirs
        sub.Free()
    else:
        assert sub == MPI.COMM_NULL
    lone = ic.Split(0 if x.lrank == 0 else MPI.UNDEFINED)
    if x.lrank == 0:
        assert lone.Get_size() == 1 and lone.Get_remote_size() == 1
        assert lone.allgather(rank) == [x.theirs[0]]
        lone.Free()
    else:
        assert lone == MPI.COMM_NULL
    # Split_type: every rank of this machine in one.
    shared = ic.Split_type(MPI.COMM_TYPE_SHARED)
    assert shared.Get_size() == len(x.mine) and shared.Get_remote_size() == len(x.theirs)
    shared.Free()
    assert ic.Split_type(MPI.UNDEFINED) == MPI.COMM_NULL
    # Create: each group names its first member (and its last, for the even group).
    local = ic.Get_group()
    picked = [0] if x.color == 1 else sorted({0, len(x.mine) - 1})
    part = ic.Create(local.Incl(picked))
    if x.lrank in picked:
        their_picked = [0] if x.color == 0 else sorted({0, len(x.theirs) - 1})
        assert world_ranks(part.Get_remote_group()) == [x.theirs[i] for i in their_picked]
        assert part.allreduce([rank], op=MPI.SUM) == [x.theirs[i] for i in their_picked]
        part.Free()
    else:
        assert part == MPI.COMM_NULL
    # Merge: the high group last; with equal flags the group holding world rank 0 first.
    merged = ic.Merge(high=x.color == 0)
    order = x.theirs + x.mine if x.color == 0 else x.mine + x.theirs
    assert merged.Get_rank() == order.index(rank) and merged.Get_size() == size
    assert merged.allgather(rank) == order
    merged.Free()
    merged = ic.Merge(high=True)
    order = sorted([x.mine, x.theirs])
    assert merged.allgather(rank) == order[0] + order[1]
    merged.Free()
    # Create_from_groups: congruent with the original.
    remote = ic.Get_remote_group()
    made = MPI.Intercomm.Create_from_groups(local, 0, remote, 0, stringtag="tests.inter")
    assert made.Compare(ic) == MPI.CONGRUENT and made.allgather(rank) == x.theirs
    made.Free()
    # Disconnect after work in flight, Free.
    dup.send(rank, dest=0, tag=3)
    if x.lrank == 0:
        assert sorted(dup.recv(source=i, tag=3) for i in range(len(x.theirs))) == x.theirs
    dup.Disconnect()
    assert dup == MPI.COMM_NULL
    for c in (idup, clone):
        c.Free()
    local.Free()
    remote.Free()


def comm_split(comm, root):
    """mpi4py.futures._core.comm_split, as mpi4py 4.1.2 writes it."""
    if comm.Get_size() == 1:
        return MPI.Intercomm(MPI.COMM_NULL), MPI.Intracomm(MPI.COMM_NULL)
    rank = comm.Get_rank()
    allgroup = comm.Get_group()
    group = allgroup.Incl([root]) if rank == root else allgroup.Excl([root])
    allgroup.Free()
    intracomm = comm.Create(group)
    group.Free()
    if rank == root:
        local_leader, remote_leader = 0, 0 if root else 1
    else:
        local_leader, remote_leader = 0, root
    intercomm = intracomm.Create_intercomm(local_leader, comm, remote_leader, tag=0)
    if rank == root:
        intracomm.Free()
    return intercomm, intracomm


def check_futures_pattern():
    """The client (rank 0) and its servers, as mpi4py.futures' MPICommExecutor runs them."""
    comm, intracomm = comm_split(world, 0)
    if size == 1:
        assert comm == MPI.COMM_NULL and intracomm == MPI.COMM_NULL
        return
    barrier = comm.Ibarrier()
    while not barrier.Test():
        pass
    tag = 5
    if rank == 0:
        comm.bcast({"main": True}, MPI.ROOT)
        rbuf = bytearray([False])
        comm.Allreduce(bytearray([False]), rbuf, op=MPI.LAND)
        assert rbuf[0] == 1
        workers = comm.Get_remote_size()
        pending = [comm.issend(("square", pid), pid, tag) for pid in range(workers)]
        status = MPI.Status()
        results = {}
        while len(results) < workers:
            if not comm.iprobe(MPI.ANY_SOURCE, tag, status):
                continue
            pid = status.source
            results[pid] = comm.recv(None, pid, tag, status)
            assert status.source == pid
        MPI.Request.Waitall(pending)
        assert results == {pid: pid * pid for pid in range(workers)}, results
        stops = [comm.issend(None, pid, tag) for pid in range(workers)]
        MPI.Request.Waitall(stops)
    else:
        assert comm.bcast(None, 0) == {"main": True}
        rbuf = bytearray([True])
        comm.Allreduce(bytearray([True]), rbuf, op=MPI.LAND)
        assert rbuf[0] == 0
        status = MPI.Status()
        while True:
            while not comm.iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG, status):
                pass
            task = comm.recv(None, status.source, status.tag, status)
            if task is None:
                break
            reply = comm.issend(task[1] * task[1], 0, tag)
            reply.wait()
        assert intracomm.allreduce(1) == size - 1
        intracomm.Free()
    comm.Disconnect()
    assert comm == MPI.COMM_NULL


def check_null():
    null = MPI.Intercomm()
    assert null == MPI.COMM_NULL and not null
    assert MPI.Intercomm(MPI.COMM_NULL) == MPI.COMM_NULL
    for method, args in (("Get_remote_size", ()), ("Get_remote_group", ()), ("Merge", (True,))):
        expect_error(MPI.ERR_COMM, getattr(null, method), *args)


def main():
    check_null()
    if size > 1:
        for i, split in enumerate(SPLITS):
            x = Inter(split, last_leader=i == 2)
            check_identity(x)
            check_p2p(x)
            check_collectives_objects(x)
            for nb, persistent in ((False, False), (True, False), (False, True)):
                check_collectives_buffers(x, nb, persistent)
            check_overlap(x)
            check_management(x)
            x.free()
    check_futures_pattern()
    assert world.allreduce(1) == size
    if rank == 0:
        print(f"intercomm ok {size}")


main()
