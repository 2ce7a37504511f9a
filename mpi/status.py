"""``MPI.Status``: source, tag, error and byte count of a completed receive or probe."""

from __future__ import annotations

from array import array
from typing import Any

from vpool.mpi import errors
from vpool.mpi.constants import ANY_SOURCE, ANY_TAG, UNDEFINED
from vpool.mpi.datatypes import BYTE, Datatype
from vpool.mpi.derived import wire_size

_LO, _HI, _SRC, _TAG, _ERR = range(5)


class Status:
    """Five C ints laid out as MPICH's ``MPI_Status`` (count_lo, count_hi_and_cancelled,
    MPI_SOURCE, MPI_TAG, MPI_ERROR), so ``tomemory`` gives a live view as mpi4py does."""

    __slots__ = ("_m",)

    def __init__(self, status: Status | None = None) -> None:
        if status is not None:
            if not isinstance(status, Status):
                raise TypeError(f"expected a Status, got {type(status).__name__}")
            self._m = array("i", status._m)
        else:
            self._m = array("i", (0, 0, ANY_SOURCE, ANY_TAG, errors.SUCCESS))

    def _fill(self, source: int, tag: int, count: int, error: int = errors.SUCCESS) -> None:
        m = self._m
        m[_SRC] = source
        m[_TAG] = tag
        m[_ERR] = error
        if count >> 31:
            m[_HI] = 0
            self._count = count
        else:
            m[_LO] = count
            m[_HI] = 0

    @property
    def _count(self) -> int:
        m = self._m
        return (m[_LO] & 0xFFFFFFFF) | ((m[_HI] >> 1) << 32)

    @_count.setter
    def _count(self, count: int) -> None:
        m = self._m
        lo = count & 0xFFFFFFFF
        m[_LO] = lo - (1 << 32) if lo >> 31 else lo
        m[_HI] = ((count >> 32) << 1) | (m[_HI] & 1)

    @property
    def _cancelled(self) -> bool:
        return bool(self._m[_HI] & 1)

    @_cancelled.setter
    def _cancelled(self, flag: bool) -> None:
        m = self._m
        m[_HI] = (m[_HI] & ~1) | (1 if flag else 0)

    @property
    def _source(self) -> int:
        return self._m[_SRC]

    @_source.setter
    def _source(self, value: int) -> None:
        self._m[_SRC] = value

    @property
    def _tag(self) -> int:
        return self._m[_TAG]

    @_tag.setter
    def _tag(self, value: int) -> None:
        self._m[_TAG] = value

    @property
    def _error(self) -> int:
        return self._m[_ERR]

    @_error.setter
    def _error(self, value: int) -> None:
        self._m[_ERR] = value

    def tomemory(self) -> memoryview:
        return memoryview(self._m)

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
        _check_type(datatype)
        size = wire_size(datatype)
        if size == 0:
            return 0
        count, rest = divmod(self._count, size)
        return UNDEFINED if rest else count

    def Get_elements(self, datatype: Datatype) -> int:
        _check_type(datatype)
        base = datatype._base or datatype
        size = base.extent
        if size == 0:
            return 0
        count, rest = divmod(self._count, size)
        return UNDEFINED if rest else count

    def Set_elements(self, datatype: Datatype, count: int) -> None:
        _check_type(datatype)
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
        return list(self._m)

    @classmethod
    def f2py(cls, arg: list[int]) -> Status:
        st = cls()
        st._m = array("i", arg)
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


def _check_type(datatype: Datatype) -> None:
    if not datatype:
        raise errors.MPIException(errors.ERR_TYPE, "null datatype")
