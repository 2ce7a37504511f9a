"""Test benches for the MPI runtime over the router of ``vsdk mpiexec``, without a pool: a rank
killed and restarted with replay (``vpool.protocol.rank_ft``), or checkpointed and restored
without CRIU (``vpool.mpi.checkpoint``). Not part of vpool (nothing installed starts them): the
tests run ``python -m tests.mpi.bench.replay --kill RANK:N --ckpt RANK:N:M[:orphan] -n N app.py
args`` (see ``replay``)."""
