"""Ranks 0 and 1 exchange messages of 1 KiB, 64 KiB, 1 MiB and 64 MiB both ways: as numpy
buffers (``Send``/``Recv``) and as pickled objects (``send``/``recv``: a bytes object, and a
dict holding bytes). Every payload is pseudo-random bytes that depend on its kind, size and
direction (``shake_128`` of a label: the same on every run and machine). The receiver checks
what it got against what was sent and rank 0 prints one line per exchange, in a fixed order:

    <kind> <size> <src>-><dst> sha256 <digest of what was received> ok|MISMATCH

Runs as it is with `mpiexec -n 2 python big_messages.py`. Nothing of an exchange outlives it
(a 64 MiB one holds a few 64 MiB buffers while it runs, never all of them).
"""

import hashlib

import numpy as np
from mpi4py import MPI

SIZES = (1 << 10, 64 << 10, 1 << 20, 64 << 20)
KINDS = ("numpy", "bytes", "dict")

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
assert comm.Get_size() == 2, "run me on 2 ranks"


def pattern(kind, size, src, dst):
    """The payload of ``size`` bytes that ``src`` sends to ``dst`` as ``kind``."""
    return hashlib.shake_128(f"big_messages {kind} {size} {src}->{dst}".encode()).digest(size)


def make(kind, size, src, dst):
    data = pattern(kind, size, src, dst)
    if kind == "numpy":
        return np.frombuffer(data, dtype=np.int64)
    if kind == "bytes":
        return data
    return {"src": src, "dst": dst, "size": size, "payload": data, "tail": [size, src, dst]}


def payload(kind, got, size, src, dst):
    """The bytes received, and whether the rest of the message is as sent."""
    if kind == "numpy":
        return memoryview(got).cast("B"), got.dtype == np.int64 and got.size == size // 8
    if kind == "bytes":
        return got, type(got) is bytes
    rest = {k: v for k, v in got.items() if k != "payload"}
    return got["payload"], rest == {"src": src, "dst": dst, "size": size, "tail": [size, src, dst]}


def exchange(kind, size, src, dst):
    """Send one message from ``src`` to ``dst``; the receiver returns its report line."""
    tag = KINDS.index(kind) * 100 + SIZES.index(size)
    if rank == src:
        msg = make(kind, size, src, dst)
        if kind == "numpy":
            comm.Send([msg, MPI.INT64_T], dest=dst, tag=tag)
        else:
            comm.send(msg, dest=dst, tag=tag)
        return None
    if kind == "numpy":
        got = np.empty(size // 8, dtype=np.int64)
        status = MPI.Status()
        comm.Recv([got, MPI.INT64_T], source=src, tag=tag, status=status)
        whole = status.Get_count(MPI.BYTE) == size
    else:
        got = comm.recv(source=src, tag=tag)
        whole = True
    data, rest_ok = payload(kind, got, size, src, dst)
    digest = hashlib.sha256(data).hexdigest()
    sent = hashlib.sha256(pattern(kind, size, src, dst)).hexdigest()
    ok = whole and rest_ok and len(data) == size and digest == sent
    return f"{kind} {size} {src}->{dst} sha256 {digest} {'ok' if ok else 'MISMATCH'}"


lines = []  # rank 1's lines go to rank 0 at the end: one rank prints, in a fixed order
for size in SIZES:
    for kind in KINDS:
        for src, dst in ((0, 1), (1, 0)):
            line = exchange(kind, size, src, dst)
            if line is not None:
                lines.append(line)

everyone = comm.gather(lines, root=0)
if rank == 0:
    for theirs, mine in zip(everyone[1], everyone[0], strict=True):
        print(theirs)  # src 0 -> dst 1, received by rank 1
        print(mine)  # src 1 -> dst 0, received by rank 0
    print(f"exchanged {sum(len(got) for got in everyone)} messages")
