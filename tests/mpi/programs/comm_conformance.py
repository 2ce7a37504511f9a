"""Communicator and topology behaviour checked on every rank (run by test_comm_conformance.py).

Prints ``comm conformance ok N`` on rank 0 when every check passed at every rank.
"""

import pickle

from mpi4py import MPI

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()


def check_create_group_apart_from_parent_collectives():
    # Members of a subgroup agree on a context while a non-blocking collective of the parent
    # (its first, so the first number of its sequence) has receives posted: the agreement's
    # messages must never match them. At 4 ranks, rank 2 waits in the Ibcast (root 3) for
    # rank 1, which forwards only when it waits, after the Create_group of ranks 1 and 2.
    chosen = [1, 2] if size >= 4 else [0]
    buf = bytearray(b"bcastmsg" if rank == 3 else 8)
    bcast = world.Ibcast(buf, root=3 if size >= 4 else 0)
    members = world.Get_group().Incl(chosen)
    if rank in chosen:
        sub = world.Create_group(members, tag=7)
        assert sub.Get_size() == len(chosen)
        assert sub.allreduce(1) == sub.Get_size()
        sub.Free()
    bcast.Wait()
    assert size < 4 or buf == b"bcastmsg", buf
    assert world.allreduce(rank) == size * (size - 1) // 2
    members.Free()


def check_create_from_group():
    half = world.Get_group().Incl([r for r in range(size) if r % 2 == rank % 2])
    comm = MPI.Intracomm.Create_from_group(half, stringtag="tests.comm")
    assert comm.Get_size() == half.Get_size()
    assert comm.Get_rank() == half.Get_rank()
    assert comm.allgather(rank) == [r for r in range(size) if r % 2 == rank % 2]
    comm.Free()
    half.Free()


def check_cart_neighbor_pairing():
    # Periodic 1-D ring: what arrives from the -1 neighbour is what it sent to its +1 one,
    # even when both neighbours are the same process (1 or 2 ranks).
    cart = world.Create_cart([size], periods=True)
    got = cart.neighbor_alltoall([("minus", rank), ("plus", rank)])
    left, right = (rank - 1) % size, (rank + 1) % size
    assert got == [("plus", left), ("minus", right)], got
    assert cart.neighbor_allgather(rank) == [left, right]
    line = world.Create_cart([size], periods=False)
    got = line.neighbor_allgather(rank)
    assert got == [rank - 1 if rank else None, rank + 1 if rank < size - 1 else None], got
    line.Free()
    cart.Free()


def check_dist_graph():
    # Every rank names the edges of rank (rank + 1) % size: to its two ring neighbours.
    owner = (rank + 1) % size
    dests = [(owner - 1) % size, (owner + 1) % size]
    topo = world.Create_dist_graph([owner], [2], dests, [10 * owner, 10 * owner + 1])
    assert MPI.Distgraphcomm(topo) == topo
    assert topo.topology == MPI.DIST_GRAPH and topo.is_topo
    ins, outs, weights = topo.Get_dist_neighbors()
    assert sorted(outs) == sorted([(rank - 1) % size, (rank + 1) % size]), outs
    assert sorted(ins) == sorted([(rank - 1) % size, (rank + 1) % size]), ins
    assert weights is not None and sorted(weights[1]) == [10 * rank, 10 * rank + 1]
    # A user receive with ANY_TAG posted first must not take the collective's messages.
    left = (rank - 1) % size
    req = topo.irecv(source=left)
    assert topo.neighbor_allgather(rank) == ins
    topo.send(("user", rank), dest=(rank + 1) % size, tag=5)
    assert req.wait() == ("user", left)
    handle = topo.toint()
    again = MPI.Comm.fromint(handle)
    assert type(again) is MPI.Distgraphcomm and again == topo
    topo.Free()
    adj = world.Create_dist_graph_adjacent([left], [(rank + 1) % size])
    assert adj.Get_dist_neighbors_count() == (1, 1, False)
    assert adj.neighbor_alltoall([rank]) == [left]
    adj.Free()


def check_split_types():
    chain = [world]
    while True:
        info = MPI.Info.Create()
        comm = chain[-1].Split_type(MPI.COMM_TYPE_HW_UNGUIDED, info=info)
        if comm == MPI.COMM_NULL:
            info.Free()
            break
        assert comm.Get_size() < chain[-1].Get_size()
        assert info.Get("mpi_hw_resource_type")
        info.Free()
        chain.append(comm)
    for comm in chain[1:]:
        comm.Free()
    info = MPI.Info.Create()
    info.Set("mpi_hw_resource_type", "mpi_shared_memory")
    comm = world.Split_type(MPI.COMM_TYPE_HW_GUIDED, info=info)
    assert comm != MPI.COMM_NULL
    comm.Free()
    assert world.Split_type(MPI.COMM_TYPE_RESOURCE_GUIDED) == MPI.COMM_NULL
    info.Free()


def check_handles():
    assert pickle.loads(pickle.dumps(world)) is world
    assert pickle.loads(pickle.dumps(MPI.COMM_NULL)) is MPI.COMM_NULL
    copy = pickle.loads(pickle.dumps(MPI.Intracomm(world)))
    assert copy == world and copy is not world
    dup = world.Dup()
    try:
        pickle.dumps(dup)
    except ValueError:
        pass
    else:
        raise AssertionError("a communicator other than the predefined ones pickled")
    for bad in ((1, 2), world):
        cls = MPI.Comm if bad != world else MPI.Cartcomm
        try:
            cls(bad)
        except TypeError:
            pass
        else:
            raise AssertionError(f"{cls.__name__}({bad!r}) accepted")
    dup.Attach_buffer(MPI.BUFFER_AUTOMATIC)
    dup.Flush_buffer()
    assert dup.Detach_buffer() is MPI.BUFFER_AUTOMATIC
    dup.Free()


for check in (
    check_create_group_apart_from_parent_collectives,
    check_create_from_group,
    check_cart_neighbor_pairing,
    check_dist_graph,
    check_split_types,
    check_handles,
):
    check()
    world.Barrier()

if rank == 0:
    print(f"comm conformance ok {size}")
