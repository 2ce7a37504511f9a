"""Attributes, error handlers and info of communicators (mixed into ``Comm``).

The predefined attributes of MPI answer as MPICH does on one machine; user attributes are kept
per communicator handle. Errors always raise ``MPI.Exception`` (mpi4py's default), whatever
handler a program sets.
"""

from __future__ import annotations

from typing import Any

from vpool.mpi import errors
from vpool.mpi.constants import (
    ANY_SOURCE,
    APPNUM,
    HOST,
    IO,
    KEYVAL_INVALID,
    LASTUSEDCODE,
    PROC_NULL,
    TAG_UB,
    TAG_UB_VALUE,
    UNIVERSE_SIZE,
    WTIME_IS_GLOBAL,
)

_next_keyval = 0x70000000


class CommAttributes:
    _core: Any

    def Get_attr(self, keyval: int) -> Any:
        h = self._core()
        if keyval == KEYVAL_INVALID:
            raise errors.MPIException(errors.ERR_KEYVAL, "invalid keyval")
        if keyval == TAG_UB:
            return TAG_UB_VALUE
        if keyval == HOST:
            return PROC_NULL
        if keyval == IO:
            return ANY_SOURCE
        if keyval == WTIME_IS_GLOBAL:
            return False
        if keyval == UNIVERSE_SIZE:
            return h.eng.universe
        if keyval == APPNUM:
            return 0
        if keyval == LASTUSEDCODE:
            return errors.ERR_LASTCODE
        return h.attrs.get(keyval)

    def Set_attr(self, keyval: int, attrval: Any) -> None:
        self._core().attrs[keyval] = attrval

    def Delete_attr(self, keyval: int) -> None:
        self._core().attrs.pop(keyval, None)

    @classmethod
    def Create_keyval(
        cls, copy_fn: Any = None, delete_fn: Any = None, nopython: bool = False
    ) -> int:
        global _next_keyval
        _next_keyval += 1
        return _next_keyval

    @classmethod
    def Free_keyval(cls, keyval: int) -> int:
        return KEYVAL_INVALID

    def Get_errhandler(self) -> Any:
        from vpool.mpi.handles import ERRORS_RETURN

        return ERRORS_RETURN

    def Set_errhandler(self, errhandler: Any) -> None:
        self._core()

    def Call_errhandler(self, errorcode: int) -> None:
        raise errors.MPIException(errorcode)

    def Get_info(self) -> Any:
        from vpool.mpi.handles import Info

        return Info.Create()

    def Set_info(self, info: Any) -> None:
        self._core()

    @property
    def info(self) -> Any:
        return self.Get_info()

    @info.setter
    def info(self, value: Any) -> None:
        self.Set_info(value)
