"""``MPI.buffer`` (alias ``MPI.memory``): mpi4py 4.1's flat byte buffer, as ``Alloc_mem`` returns.

A buffer is a one-dimensional, C-contiguous run of unsigned bytes over memory that something else
owns: another buffer-protocol object (``buffer(obj)``, ``frombuffer``), a raw address
(``fromaddress``), or a bytearray it allocated (``allocate``). It exports the buffer protocol,
aliasing that memory, so it can be sent, received into and wrapped by numpy without copies.

Python 3.11 gives a class written in Python no way to export the buffer protocol (PEP 688's
``__buffer__`` came in 3.12), so the type is a ``uint8`` numpy array subclass: numpy exports the
bytes and this class narrows the array API to mpi4py's (int items, contiguous slices only, no
arithmetic, identity equality, not picklable). Importing this module imports numpy, which is
why ``MPI`` resolves ``buffer`` lazily.
"""

from __future__ import annotations

import operator
import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np

__all__ = ["buffer"]

_U1 = np.dtype(np.uint8)
_NAME = "mpi4py.MPI.buffer"


def _flat(obj: Any) -> memoryview:
    """A flat 'B' view of ``obj``'s bytes; TypeError if it has no buffer protocol."""
    mv = memoryview(obj)
    if not mv.c_contiguous:
        raise BufferError("memoryview: underlying buffer is not C-contiguous")
    if mv.format == "B" and mv.ndim == 1:
        return mv
    return pickle.PickleBuffer(mv).raw()


def _byte(value: Any) -> int:
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError("an integer is required") from None
    if not 0 <= v <= 255:
        raise OverflowError(f"value {v} does not fit in an unsigned char")
    return v


class buffer(np.ndarray):
    """Buffer."""

    __slots__ = ("_keep", "_null", "_obj")
    _obj: Any
    _null: bool
    _keep: Any

    # No arithmetic or ufuncs (numpy raises TypeError); compared and hashed by identity.
    __array_ufunc__ = None
    __eq__ = object.__eq__  # type: ignore[assignment]
    __ne__ = object.__ne__  # type: ignore[assignment]
    __lt__ = object.__lt__  # type: ignore[assignment]
    __le__ = object.__le__  # type: ignore[assignment]
    __gt__ = object.__gt__  # type: ignore[assignment]
    __ge__ = object.__ge__  # type: ignore[assignment]
    __hash__ = object.__hash__  # type: ignore[assignment]

    def __new__(cls, *args: Any) -> buffer:
        if len(args) > 1:
            raise TypeError(f"buffer() takes at most 1 argument ({len(args)} given)")
        if not args:
            return cls._wrap(memoryview(bytearray(0)), None, readonly=False, null=True)
        obj = args[0]
        mv = _flat(obj)
        return cls._wrap(mv, obj, readonly=mv.readonly)

    @classmethod
    def _wrap(cls, mv: memoryview, obj: Any, *, readonly: bool, null: bool = False) -> buffer:
        self = np.ndarray.__new__(cls, (mv.nbytes,), _U1, buffer=mv)
        if readonly:
            self.flags.writeable = False
        self._obj, self._null, self._keep = obj, null, None
        return self

    def __array_finalize__(self, src: Any) -> None:
        # A view numpy made of a buffer (``.view()``, ``.reshape()``): same object, same memory.
        self._obj = getattr(src, "_obj", None)
        self._null = False
        self._keep = None

    # ---- constructors ------------------------------------------------------------------------

    @classmethod
    def allocate(cls, nbytes: int, clear: bool = False) -> buffer:
        """Buffer allocation."""
        n = operator.index(nbytes)
        if n < 0:
            raise ValueError("expecting non-negative size")
        mem = bytearray(n)  # always cleared: Python has no uninitialized allocation
        return cls._wrap(memoryview(mem), mem, readonly=False)

    @classmethod
    def frombuffer(cls, obj: Any, readonly: bool = False) -> buffer:
        """Buffer from buffer-like object."""
        mv = _flat(obj)
        if not readonly and mv.readonly:
            raise BufferError("Object is not writable.")
        return cls._wrap(mv, obj, readonly=bool(readonly) or mv.readonly)

    @classmethod
    def fromaddress(cls, address: int, nbytes: int, readonly: bool = False) -> buffer:
        """Buffer from address and size in bytes."""
        addr, n = operator.index(address), operator.index(nbytes)
        if n < 0:
            raise ValueError("expecting non-negative buffer length")
        if addr == 0:
            if n > 0:
                raise ValueError("expecting non-NULL address")
            return cls._wrap(memoryview(bytearray(0)), None, readonly=bool(readonly), null=True)
        import ctypes

        mem = (ctypes.c_ubyte * n).from_address(addr)
        return cls._wrap(_flat(mem), None, readonly=bool(readonly))

    # ---- properties --------------------------------------------------------------------------

    @property
    def address(self) -> int:
        """Buffer address."""
        if self._null:
            return 0
        return int(self.__array_interface__["data"][0])

    @property
    def obj(self) -> Any:
        """Object exposing buffer."""
        return self._obj

    @property  # type: ignore[override]
    def nbytes(self) -> int:
        """Buffer size (in bytes)."""
        return int(self.size)

    @property
    def readonly(self) -> bool:
        """Buffer is read-only."""
        return not self.flags.writeable

    @property
    def format(self) -> str:
        """Format of each element."""
        return "B"

    @property  # type: ignore[override]
    def itemsize(self) -> int:
        """Size (in bytes) of each element."""
        return 1

    # ---- methods -----------------------------------------------------------------------------

    def cast(self, format: str, shape: list[int] | tuple[int, ...] | None = None) -> memoryview:
        """Cast to a `memoryview` with new format or shape."""
        mv = memoryview(self)
        return mv.cast(format) if shape is None else mv.cast(format, shape)

    def tobytes(self, order: str | None = None) -> bytes:  # type: ignore[override]
        """Return the data in the buffer as a byte string."""
        return memoryview(self).tobytes()

    def toreadonly(self) -> buffer:
        """Return a readonly version of the buffer object."""
        return type(self)._wrap(memoryview(self), self._obj, readonly=True, null=self._null)

    def release(self) -> None:
        """Release the underlying buffer exposed by the buffer object."""
        # The old memory stays referenced until this object dies: a memoryview taken earlier
        # still points into it, and must not outlive it.
        self._keep = self.base
        np.ndarray.__setstate__(self, (1, (0,), _U1, False, b""))
        self._obj, self._null = None, True

    # ---- sequence ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return int(self.size)

    def __bool__(self) -> bool:
        return self.size > 0

    def __iter__(self) -> Iterator[int]:
        return iter(self.tobytes())

    def __contains__(self, value: object) -> bool:
        return any(b == value for b in self)

    def _region(self, key: Any) -> tuple[int, int] | int:
        n = int(self.size)
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                raise IndexError("slice with step not supported")
            return start, max(start, stop)
        try:
            i = operator.index(key)
        except TypeError:
            raise TypeError("index must be integer or slice") from None
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("index out of range")
        return i

    def __getitem__(self, key: Any) -> Any:
        where = self._region(key)
        if isinstance(where, int):
            return int(np.ndarray.__getitem__(self, where))
        start, stop = where
        return type(self)._wrap(memoryview(self)[start:stop], self, readonly=self.readonly)

    def __setitem__(self, key: Any, value: Any) -> None:
        if self.readonly:
            raise TypeError("buffer is read-only")
        where = self._region(key)
        if isinstance(where, int):
            np.ndarray.__setitem__(self, where, _byte(value))
            return
        start, stop = where
        try:
            fill = operator.index(value)
        except TypeError:
            fill = None
        if fill is not None:
            np.ndarray.__setitem__(self, slice(start, stop), _byte(fill))
            return
        try:
            src = _flat(value)
        except TypeError:
            raise TypeError(
                f"a bytes-like object is required, not '{type(value).__name__}'"
            ) from None
        if src.nbytes != stop - start:
            raise ValueError("slice length does not match buffer")
        np.ndarray.__setitem__(self, slice(start, stop), np.frombuffer(src, _U1))

    def __delitem__(self, key: Any) -> None:
        raise NotImplementedError(f"Subscript deletion not supported by {_NAME}")

    # ---- identity ----------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"<{_NAME} object at {id(self):#x}>"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError(f"cannot pickle '{_NAME}' object")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(f"cannot pickle '{_NAME}' object")
