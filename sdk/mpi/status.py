"""``MPI.Status``: source, tag, error and byte count of a completed receive or probe."""

from __future__ import annotations

from typing import Any

from vpool.sdk.mpi import errors
from vpool.sdk.mpi.constants import ANY_SOURCE, ANY_TAG, UNDEFINED
from vpool.sdk.mpi.datatypes import BYTE, Datatype


class Status:
    __slots__ = ("_cancelled", "_count", "_error", "_source", "_tag")

    def __init__(self, status: Status | None = None) -> None:
        if status is not None:
            self._source, self._tag, self._error = status._source, status._tag, status._error
            self._count, self._cancelled = status._count, status._cancelled
        else:
            self._source = ANY_SOURCE
            self._tag = ANY_TAG
            self._error = errors.SUCCESS
            self._count = 0
            self._cancelled = False

    def _fill(self, source: int, tag: int, count: int, error: int = errors.SUCCESS) -> None:
        self._source, self._tag, self._count, self._error = source, tag, count, error
        self._cancelled = False

    def Get_source(self) -> int:
        return self._source

    def Set_source(self, source: int) -> None:
        self._source = source

    def Get_tag(self) -> int:
        return self._tag

    def Set_tag(self, tag: int) -> None:
        self._tag = tag

    def Get_error(self) -> int:
        return self._error

    def Set_error(self, error: int) -> None:
        self._error = error

    def Get_count(self, datatype: Datatype = BYTE) -> int:
        size = datatype.extent
        if size == 0:
            return 0
        count, rest = divmod(self._count, size)
        return UNDEFINED if rest else count

    def Get_elements(self, datatype: Datatype) -> int:
        base = datatype._base or datatype
        size = base.extent
        if size == 0:
            return 0
        count, rest = divmod(self._count, size)
        return UNDEFINED if rest else count

    def Set_elements(self, datatype: Datatype, count: int) -> None:
        self._count = count * (datatype._base or datatype).extent

    def Is_cancelled(self) -> bool:
        return self._cancelled

    def Set_cancelled(self, flag: bool) -> None:
        self._cancelled = bool(flag)

    source = property(Get_source, Set_source)
    tag = property(Get_tag, Set_tag)
    error = property(Get_error, Set_error)
    cancelled = property(Is_cancelled, Set_cancelled)

    @property
    def count(self) -> int:
        return self.Get_count(BYTE)

    @count.setter
    def count(self, value: int) -> None:
        self._count = value

    def py2f(self) -> list[int]:
        return [self._count, int(self._cancelled), self._source, self._tag, self._error]

    @classmethod
    def f2py(cls, arg: list[int]) -> Status:
        st = cls()
        st._count, cancelled, st._source, st._tag, st._error = arg
        st._cancelled = bool(cancelled)
        return st

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Status):
            return NotImplemented
        return self.py2f() == other.py2f()

    def __hash__(self) -> int:
        return hash(tuple(self.py2f()))

    def __copy__(self) -> Status:
        return Status(self)

    def __reduce__(self) -> Any:
        return (Status.f2py, (self.py2f(),))

    def __repr__(self) -> str:
        return f"<Status source={self._source} tag={self._tag} count={self._count}>"
