"""vpool.mpi: the MPI runtime inside rank processes, serving ``mpi4py.MPI``.

Programs import ``mpi4py``; the agent puts ``shim/`` first on their ``PYTHONPATH``, so they get
the shim package ``shim/mpi4py``, whose ``MPI`` module is ``vpool.mpi.MPI``. Importing this
package itself does nothing: MPI starts when ``vpool.mpi.MPI`` is imported.

Modules by concern:

- ``transport``: the unix socket to the agent (frames, progress, back-pressure);
- ``runtime``: the point-to-point engine (sends, posted receives, local delivery);
- ``matching``: the posted and unexpected queues, every matching decision;
- ``request``, ``status``, ``message``: completion objects;
- ``buffers``, ``datatypes`` (with ``typedict``), ``serialization``: what a message's bytes are;
- ``ops``, ``coll``, ``collbuf``: reductions and collectives over point-to-point;
- ``comm`` (with ``commcoll``, ``commattr``), ``group``, ``topology``, ``handles``:
  communicators and friends;
- ``environment``: Init/Finalize, exit hook, Abort, clocks;
- ``MPI``: the namespace.
"""

from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent / "shim"
