"""A spawned process that fails (``tests/mpi/test_spawn.py``): ``spawn_failures.py exit`` (a
worker exits with code 3: the job ends with it), ``spawn_failures.py reported`` (a spawn with
``vpool_reported``: worker 1 is killed by SIGKILL, is declared failed and the parent, polling
with ANY_SOURCE probes, gets ERR_PROC_FAILED, finds it with Get_failed and goes on with worker
0; rank 0 prints ``reported ok``)."""

import os
import signal
import sys

from mpi4py import MPI


def worker(mode: str) -> None:
    parent = MPI.Comm.Get_parent()
    rank = MPI.COMM_WORLD.Get_rank()
    if rank == 1:
        if mode == "exit":
            sys.exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    assert parent.recv(source=0, tag=1) == "go"
    parent.send("ok", dest=0, tag=2)
    parent.Free()


def parents(mode: str) -> None:
    info = MPI.Info.Create()
    info.Set("vpool_reported", "true" if mode == "reported" else "false")
    child = MPI.COMM_SELF.Spawn(sys.executable, [__file__, "worker", mode], 2, info=info)
    info.Free()
    child.send("go", dest=0, tag=1)
    if mode == "exit":
        child.recv(source=0, tag=2)
        child.recv(source=1, tag=2)  # never comes: the job ends before
        raise AssertionError("worker 1 exited with 3: the job should have ended")
    # Worker 1 is gone: ANY_SOURCE probes raise once its failure is observed.
    status = MPI.Status()
    got = []
    while True:
        try:
            if child.iprobe(MPI.ANY_SOURCE, 2, status):
                got.append(child.recv(source=status.Get_source(), tag=2))
        except MPI.Exception as exc:
            assert exc.Get_error_class() == MPI.ERR_PROC_FAILED, exc
            break
    failed = child.Get_failed()
    assert failed.Get_size() == 1, failed.Get_size()
    assert MPI.Group.Translate_ranks(failed, [0], child.Get_remote_group()) == [1]
    child.Ack_failed()
    if not got:
        got.append(child.recv(source=MPI.ANY_SOURCE, tag=2))
    assert got == ["ok"], got
    child.Free()
    print("reported ok", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(sys.argv[2])
    else:
        parents(sys.argv[1])
