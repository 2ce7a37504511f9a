"""Small handle types programs pass around but the runtime gives no behaviour to:
``MPI.Info`` (a string dictionary) and ``MPI.Errhandler`` (errors always raise ``MPI.Exception``,
as with mpi4py's default)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def _error(name: str, detail: str) -> Exception:
    from vpool.mpi import errors

    return errors.MPIException(getattr(errors, name), detail)


class Info:
    __slots__ = ("_items", "_null")

    def __init__(self, info: Info | None = None) -> None:
        self._items: dict[str, str] = dict(info._items) if info is not None else {}
        self._null = info._null if info is not None else True

    @classmethod
    def Create(cls, items: Any = None) -> Info:
        info = cls()
        info._null = False
        if items:
            info._items.update(dict(items))
        return info

    def _check(self) -> None:
        if self._null:
            raise _error("ERR_INFO", "null info")

    def Dup(self) -> Info:
        self._check()
        return Info(self)

    def Free(self) -> None:
        self._check()
        self._items.clear()
        self._null = True

    def free(self) -> None:
        if not self._null and self is not INFO_ENV:
            self.Free()

    def Get(self, key: str) -> str | None:
        self._check()
        return self._items.get(key)

    def Set(self, key: str, value: str) -> None:
        self._check()
        self._items[key] = str(value)

    def Delete(self, key: str) -> None:
        self._check()
        if key not in self._items:
            raise _error("ERR_INFO_NOKEY", f"no key {key!r}")
        del self._items[key]

    def Get_nkeys(self) -> int:
        self._check()
        return len(self._items)

    def Get_nthkey(self, n: int) -> str:
        self._check()
        if not 0 <= n < len(self._items):
            raise _error("ERR_ARG", f"no key number {n}")
        return list(self._items)[n]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __getitem__(self, key: str) -> str:
        return self._items[key]

    def __setitem__(self, key: str, value: str) -> None:
        self.Set(key, value)

    def __delitem__(self, key: str) -> None:
        self.Delete(key)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def get(self, key: str, default: Any = None) -> Any:
        return self._items.get(key, default)

    def keys(self) -> Any:
        return self._items.keys()

    def values(self) -> Any:
        return self._items.values()

    def items(self) -> Any:
        return self._items.items()

    def update(self, other: Any = (), **kwds: str) -> None:
        """As a dict's (mpi4py 4): keys and values from a mapping or pairs, then ``kwds``."""
        self._check()
        items = other.items() if hasattr(other, "items") else other
        for key, value in (*items, *kwds.items()):
            self._items[str(key)] = str(value)

    def pop(self, key: str, *default: Any) -> Any:
        self._check()
        if key in self._items:
            return self._items.pop(key)
        if default:
            return default[0]
        raise KeyError(key)

    def popitem(self) -> tuple[str, str]:
        self._check()
        if not self._items:
            raise KeyError("popitem(): info is empty")
        return self._items.popitem()

    def copy(self) -> Info:
        return self.Dup()

    def clear(self) -> None:
        self._check()
        self._items.clear()

    def __bool__(self) -> bool:
        return not self._null


MAX_USER_ERRHANDLERS = 32  # MPICH's limit; one more raises, as the suite expects
_live_user = 0
_by_int: dict[int, Errhandler] = {}


class Errhandler:
    """``MPI.Errhandler``: a predefined handler (by name) or a program's function."""

    __slots__ = ("_fn", "_name")

    def __init__(self, errhandler: Errhandler | None = None) -> None:
        self._name = errhandler._name if errhandler is not None else ""
        self._fn: Any = errhandler._fn if errhandler is not None else None

    @classmethod
    def _named(cls, name: str) -> Errhandler:
        e = cls()
        e._name = name
        return e

    @classmethod
    def _user(cls, fn: Any) -> Errhandler:
        from vpool.mpi import errors

        global _live_user
        if _live_user >= MAX_USER_ERRHANDLERS:
            raise errors.MPIException(errors.ERR_OTHER, "too many user error handlers")
        _live_user += 1
        e = cls()
        e._name = f"user-{id(fn)}"
        e._fn = fn
        return e

    def Free(self) -> None:
        global _live_user
        if not self._name:
            raise _error("ERR_ARG", "null error handler")
        if self._fn is not None and self._name:
            _live_user -= 1
        self._name = ""
        self._fn = None

    def __bool__(self) -> bool:
        return bool(self._name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Errhandler) and other._name == self._name

    def __hash__(self) -> int:
        return hash(self._name)

    def __reduce__(self) -> Any:
        if self._fn is not None:
            raise ValueError("cannot serialize user-defined error handlers")
        predefined = _PREDEFINED.get(self._name)
        if predefined is self:
            return self._name[4:] if self._name else "ERRHANDLER_NULL"
        return (Errhandler._named, (self._name,))

    def toint(self) -> int:
        key = hash(self._name) & 0x3FFFFFFF
        _by_int[key] = self
        return key

    py2f = toint

    @classmethod
    def fromint(cls, value: int) -> Errhandler:
        return Errhandler(_by_int.get(value))

    f2py = fromint


INFO_NULL = Info()
INFO_ENV = Info.Create()
ERRHANDLER_NULL = Errhandler()
ERRORS_RETURN = Errhandler._named("MPI_ERRORS_RETURN")
ERRORS_ARE_FATAL = Errhandler._named("MPI_ERRORS_ARE_FATAL")
ERRORS_ABORT = Errhandler._named("MPI_ERRORS_ABORT")
_PREDEFINED = {e._name: e for e in (ERRORS_RETURN, ERRORS_ARE_FATAL, ERRORS_ABORT)}
