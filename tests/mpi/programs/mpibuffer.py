"""``MPI.buffer`` through the runtime on every rank (run by test_mpibuffer.py).

Prints ``mpibuffer ok N`` on rank 0 when every check passed at every rank.
"""

from mpi4py import MPI

world = MPI.COMM_WORLD
rank, size = world.Get_rank(), world.Get_size()

mem = MPI.Alloc_mem(16)
assert type(mem) is MPI.buffer and MPI.memory is MPI.buffer
assert mem.address != 0 and mem.nbytes == 16 and not mem.readonly

# A buffer is a message buffer like any other: ring exchange, received straight into one.
mem[:] = rank
got = MPI.Alloc_mem(16)
world.Sendrecv(mem, (rank + 1) % size, 5, got, (rank - 1) % size, 5)
assert got.tobytes() == bytes([(rank - 1) % size]) * 16, got.tobytes()
assert world.allreduce(mem[0]) == size * (size - 1) // 2

# Attach/Detach give the very buffer back, on the communicator and process-wide.
comm = world.Dup()
comm.Attach_buffer(mem)
assert comm.Detach_buffer() is mem
comm.Free()
MPI.Attach_buffer(mem)
MPI.Flush_buffer()
MPI.Iflush_buffer().Wait()
assert MPI.Detach_buffer().address == mem.address
try:
    MPI.Attach_buffer(MPI.buffer(b"readonly"))
except BufferError:
    pass
else:
    raise AssertionError("attached a read-only buffer")

MPI.Free_mem(mem)
MPI.Free_mem(got)
assert (mem.address, mem.nbytes, mem.obj) == (0, 0, None)

world.Barrier()
if rank == 0:
    print(f"mpibuffer ok {size}")
