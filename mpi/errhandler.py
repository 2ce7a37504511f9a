"""Error handlers of communicators (mixed into ``Comm`` ahead of ``CommAttributes``).

Each communicator handle keeps the handler set on it (default ``ERRORS_RETURN``, as mpi4py sets
for its predefined communicators). Failing MPI calls raise ``MPI.Exception`` whatever the handler;
``Call_errhandler`` runs it: a program's function is called with (comm, errorcode),
``ERRORS_ARE_FATAL``/``ERRORS_ABORT`` end the job, ``ERRORS_RETURN`` does nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vpool.mpi import errors
from vpool.mpi.handles import ERRORS_ABORT, ERRORS_ARE_FATAL, ERRORS_RETURN, Errhandler


class CommErrhandlers:
    _h: Any

    def _core(self) -> Any:
        raise NotImplementedError

    @classmethod
    def Create_errhandler(cls, errhandler_fn: Callable[[Any, int], None]) -> Errhandler:
        return Errhandler._user(errhandler_fn)

    def Get_errhandler(self) -> Errhandler:
        h = self._core()
        return Errhandler(h.errh if h.errh is not None else ERRORS_RETURN)

    def Set_errhandler(self, errhandler: Errhandler) -> None:
        h = self._core()
        if not isinstance(errhandler, Errhandler) or not errhandler:
            raise errors.MPIException(errors.ERR_ARG, "invalid error handler")
        h.errh = Errhandler(errhandler)

    def Call_errhandler(self, errorcode: int) -> None:
        h = self._core()
        eh = h.errh if h.errh is not None else ERRORS_RETURN
        if eh._fn is not None:
            eh._fn(self, errorcode)
        elif errorcode != errors.SUCCESS and eh in (ERRORS_ARE_FATAL, ERRORS_ABORT):
            from vpool.mpi import environment

            environment.abort(errorcode, f"MPI error {errorcode} with ERRORS_ARE_FATAL")

    @property
    def errhandler(self) -> Errhandler:
        return self.Get_errhandler()

    @errhandler.setter
    def errhandler(self, value: Errhandler) -> None:
        self.Set_errhandler(value)
