"""``mpi4py.util.pkl5``: mpi4py's pickle-based communication of large messages.

vpool's lower-case calls already use pickle protocol 5 with out-of-band buffers and have no
2 GiB limit, so its communicators are the plain ones.
"""

from __future__ import annotations

from mpi4py import MPI

__all__ = ["Comm", "Intercomm", "Intracomm", "Message", "Request", "pickle"]


class Comm(MPI.Comm):
    pass


class Intracomm(MPI.Intracomm):
    pass


class Intercomm(MPI.Intercomm):
    pass


Request = MPI.Request
Message = MPI.Message
pickle = MPI.pickle
