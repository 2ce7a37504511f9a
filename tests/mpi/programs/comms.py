"""Communicator management: Dup, Split, Create, COMM_SELF, groups, isolation of contexts."""

from mpi4py import MPI

world = MPI.COMM_WORLD
rank, size = world.rank, world.size

dup = world.Dup()
assert dup.rank == rank and dup.size == size and dup != world
assert world.Compare(dup) == MPI.CONGRUENT and world.Compare(world) == MPI.IDENT
# Same tag, same peers, different communicators: messages never cross.
right, left = (rank + 1) % size, (rank - 1) % size
world.send("world", dest=right, tag=5)
dup.send("dup", dest=right, tag=5)
assert dup.recv(source=left, tag=5) == "dup"
assert world.recv(source=left, tag=5) == "world"
# Collectives on one communicator do not match the other's.
assert dup.allreduce(1) == size and world.allreduce(2) == 2 * size

half = world.Split(color=rank % 2, key=-rank)
members = [r for r in range(size) if r % 2 == rank % 2]
assert half.size == len(members)
assert half.rank == sorted(members, reverse=True).index(rank)
assert half.allgather(rank) == sorted(members, reverse=True)
assert half.bcast(rank if half.rank == 0 else None) == max(members)
none = world.Split(MPI.UNDEFINED if rank == 0 else 1, rank)
assert (none == MPI.COMM_NULL) == (rank == 0)
if rank != 0:
    assert none.size == size - 1 and none.rank == rank - 1
    assert none.allreduce(rank) == sum(range(1, size))
    none.Free()
    assert none == MPI.COMM_NULL

d2 = half.Dup()
assert d2.allreduce(1) == half.size
local = world.Split_type(MPI.COMM_TYPE_SHARED)
assert local.size == size

assert MPI.COMM_SELF.size == 1 and MPI.COMM_SELF.rank == 0
MPI.COMM_SELF.send("self", dest=0, tag=1)
assert MPI.COMM_SELF.recv(source=0, tag=1) == "self"
assert MPI.COMM_SELF.allreduce(rank) == rank
sd = MPI.COMM_SELF.Dup()
assert sd.bcast(rank) == rank

g = world.Get_group()
assert g.size == size and g.rank == rank
evens = g.Incl(list(range(0, size, 2)))
ec = world.Create(evens)
if rank % 2 == 0:
    assert ec.size == evens.size and ec.rank == rank // 2
    assert ec.allgather(rank) == list(range(0, size, 2))
else:
    assert ec == MPI.COMM_NULL
cg = world.Create_group(evens) if rank % 2 == 0 else None
if cg is not None:
    assert cg.allreduce(1) == evens.size
assert MPI.Group.Translate_ranks(evens, [0], g) == [0]
# After all that, the world still matches in order.
world.send(rank, dest=right, tag=9)
assert world.recv(source=left, tag=9) == left
world.Barrier()
if rank == 0:
    print("comms ok", size)
