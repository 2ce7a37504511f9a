"""Buffer specs of upper-case calls, as mpi4py reads them, turned into flat byte views.

Accepted forms (``buf`` is any object with the buffer protocol, contiguous in C or Fortran
order; ``datatype`` a Datatype or a type code string)::

    buf                                     datatype from the buffer's format
    [buf, datatype]                         count = buffer length / datatype extent
    [buf, count]  /  [buf, (count, displ)]  datatype from the buffer's format
    [buf, count, datatype]  /  [buf, (count, displ), datatype]  /  [buf, count, displ, datatype]
    None                                    empty message

Vector forms for the ``*v`` collectives: ``[buf, counts, displs, datatype]``,
``[buf, (counts, displs), datatype]``, ``[buf, counts, datatype]``, ``[buf, counts]``.
"""

from __future__ import annotations

import operator
import pickle
from collections.abc import Callable
from typing import Any, NamedTuple

from vpool.mpi import derived, errors
from vpool.mpi.datatypes import BYTE, Datatype
from vpool.mpi.dlpack import exported_typecode, exported_view
from vpool.mpi.typedict import from_format, lookup


class _Sentinel:
    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name

    def __reduce__(self) -> str:
        return self._name

    def __bool__(self) -> bool:
        return False


IN_PLACE = _Sentinel("IN_PLACE")
BOTTOM = _Sentinel("BOTTOM")
BUFFER_AUTOMATIC = _Sentinel("BUFFER_AUTOMATIC")

_EMPTY = memoryview(bytearray(0))


class Msg(NamedTuple):
    view: memoryview  # flat unsigned-byte view of exactly the message's bytes
    items: int  # count of ``datatype`` elements (per block, for ``parse_blocks``)
    datatype: Datatype
    # For a writable buffer of a non-contiguous datatype, ``view`` is a packed copy: this
    # scatters it back into the buffer once the data arrived (see ``derived``).
    unpack: Callable[[], None] | None = None


class VMsg(NamedTuple):
    view: memoryview  # the whole buffer, flat bytes
    counts: list[int]
    displs: list[int]  # in elements of ``datatype``
    datatype: Datatype


def byte_view(obj: Any, writable: bool) -> memoryview:
    """A flat 'B' view of a contiguous buffer (C or Fortran order), no copy."""
    if obj is None:
        return _EMPTY
    if obj is BOTTOM or obj is IN_PLACE:
        raise errors.MPIException(errors.ERR_BUFFER, f"{obj!r} is not supported here")
    try:
        mv = obj if isinstance(obj, memoryview) else memoryview(obj)
    except TypeError:
        exported = exported_view(obj)
        if exported is None:
            raise TypeError(
                f"message: expected a buffer object, got {type(obj).__name__}"
            ) from None
        mv = exported
    if writable and mv.readonly:
        raise BufferError("Object is not writable.")
    if mv.format == "B" and mv.ndim == 1 and mv.c_contiguous:
        return mv
    if mv.nbytes == 0:
        return memoryview(bytearray(0))  # cast refuses shapes with a zero, such as (n, 0)
    if mv.c_contiguous:
        return mv.cast("B")
    if mv.contiguous:
        return pickle.PickleBuffer(mv).raw()
    raise BufferError("message: buffer is not contiguous")


def view_of(spec: Any, writable: bool = False) -> memoryview:
    """Just the bytes to send of a point-to-point buffer spec (the datatype does not travel;
    a non-contiguous one is packed)."""
    if spec is None or isinstance(spec, (list, tuple)):
        return parse(spec, writable).view
    return byte_view(spec, writable)


def recv_view(spec: Any) -> tuple[memoryview, Callable[[], None] | None]:
    """Where a point-to-point receive lands, and for a non-contiguous datatype the function
    that scatters it (packed there) into the user's buffer once it arrived."""
    if spec is None or isinstance(spec, (list, tuple)):
        m = parse(spec, writable=True)
        return m.view, m.unpack
    return byte_view(spec, True), None


def _datatype_of(obj: Any) -> Datatype:
    if obj is None:
        return BYTE
    try:
        mv = obj if isinstance(obj, memoryview) else memoryview(obj)
    except TypeError:
        return _exported_datatype(obj)
    return from_format(mv.format)


def _exported_datatype(obj: Any) -> Datatype:
    """The datatype of a DLPack / CUDA-array-interface buffer, from its element type."""
    if exported_view(obj) is None:
        raise TypeError(f"message: expected a buffer object, got {type(obj).__name__}")
    code = exported_typecode(obj)
    return from_format(code) if code is not None else BYTE


def _split(spec: Any) -> tuple[Any, Any, int, Datatype | None]:
    """(buffer, count or None, displacement, datatype or None) of a simple spec."""
    if not isinstance(spec, (list, tuple)):
        return spec, None, 0, None
    n = len(spec)
    buf = spec[0]
    count: Any = None
    displ = 0
    dt: Datatype | None = None
    if n == 1:
        pass
    elif n == 2:
        second = spec[1]
        if isinstance(second, (Datatype, str)):
            dt = lookup(second)
        else:
            count = second
    elif n == 3:
        count, dt = spec[1], lookup(spec[2])
    elif n == 4:
        count, displ, dt = spec[1], spec[2], lookup(spec[3])
    else:
        raise ValueError(f"message: expected 1 to 4 items, got {n}")
    if isinstance(count, tuple):
        count, displ = count
    return buf, count, displ, dt


def parse(spec: Any, writable: bool) -> Msg:
    """Read a buffer spec; the view covers exactly ``count`` elements."""
    if spec is None:
        return Msg(_EMPTY, 0, BYTE)
    if not isinstance(spec, (list, tuple)):
        view = byte_view(spec, writable)
        dt = _datatype_of(spec)
        return Msg(view, _whole(view, dt), dt)
    buf, count, displ, dt = _split(spec)
    view = byte_view(buf, writable)
    if dt is None:
        dt = _datatype_of(buf)
    if count is None:
        count = _whole(view, dt) - displ
    return _msg(view, count, displ, dt, count, writable)


def _msg(view: memoryview, count: int, displ: int, dt: Datatype, items: int, wr: bool) -> Msg:
    if not derived.packed(dt):
        return Msg(_slice(view, count, displ, dt), items, dt)
    if count < 0:
        raise errors.MPIException(errors.ERR_COUNT)
    start = displ * dt.extent
    end = start + derived.span(dt, count)
    if start < 0 or end > view.nbytes:
        raise ValueError(f"message: buffer too small: {view.nbytes} bytes, {end} needed")
    region = view[start:end]
    data = derived.pack(region, dt, count)
    if not wr:
        return Msg(data, items, dt)
    return Msg(data, items, dt, lambda: derived.unpack(data, region, dt, count))


def parse_blocks(spec: Any, blocks: int, writable: bool) -> Msg:
    """A buffer of ``blocks`` equal blocks (one per rank); ``count`` is per block, as in MPI
    (an explicit count in the spec is the count of one block)."""
    if spec is None:
        return Msg(_EMPTY, 0, BYTE)
    buf, count, displ, dt = _split(spec)
    view = byte_view(buf, writable)
    if dt is None:
        dt = _datatype_of(buf)
    if count is None:
        count = (_whole(view, dt) - displ) // blocks
    return _msg(view, count * blocks, displ, dt, count, writable)


def parse_v(spec: Any, size: int, writable: bool) -> VMsg:
    """Read a vector spec of a ``*v`` collective (counts and displacements per rank)."""
    bare = not isinstance(spec, (list, tuple))
    if bare:
        spec = [spec]
    n = len(spec)
    buf = spec[0]
    counts: Any = None
    displs: Any = None
    dt: Datatype | None = None
    # The forms of mpi4py's message_vector: a tuple in the counts place is (counts, displs).
    if n == 1 and bare:
        pass
    elif n == 2:
        if isinstance(spec[1], (Datatype, str)):
            dt = lookup(spec[1])
        else:
            counts = spec[1]
    elif n == 3:
        counts, dt = spec[1], lookup(spec[2])
    elif n == 4:
        counts, displs, dt = spec[1], spec[2], lookup(spec[3])
    else:
        raise ValueError(f"message: expecting 2 to 4 items, got {n}")
    if n < 4 and isinstance(counts, tuple):
        counts, displs = counts
    view = byte_view(buf, writable)
    if dt is None:
        dt = _datatype_of(buf)
    if counts is None:
        total = _whole(view, dt)
        counts = [total // size + (total % size > i) for i in range(size)]
    elif isinstance(counts, int):
        counts = [counts] * size
    counts = [int(c) for c in counts]
    if displs is None:  # contiguous
        displs, pos = [], 0
        for c in counts:
            displs.append(pos)
            pos += c
    elif isinstance(displs, int):  # strided
        displs = [displs * i for i in range(size)]
    displs = [int(d) for d in displs]
    if len(counts) != size or len(displs) != size:
        raise ValueError(f"message: expected {size} counts and displacements")
    return VMsg(view, counts, displs, dt)


def parse_w(
    spec: Any, size: int, writable: bool
) -> tuple[memoryview, list[int], list[int], list[Datatype]]:
    """Read an ``Alltoallw`` spec: (buffer view, counts, byte displacements, datatypes)."""
    if not isinstance(spec, (list, tuple)):
        raise TypeError("message: expecting a list or tuple")
    n = len(spec)
    counts: Any = None
    displs: Any = None
    if n == 2:
        buf, types = spec
    elif n == 3:
        buf, (counts, displs), types = spec
    elif n == 4:
        buf, counts, displs, types = spec
    else:
        raise ValueError(f"message: expecting 2 to 4 items, got {n}")
    if buf is BOTTOM:
        if counts is None or displs is None:
            raise ValueError("message: BOTTOM requires counts and displs")
        raise NotImplementedError("MPI.BOTTOM with absolute addresses")
    if counts is None and displs is None:
        counts, displs = [1] * size, [0] * size
    if not isinstance(types, (list, tuple)):
        types = [types] * size
    types = [lookup(t) for t in types]
    counts, displs = [int(c) for c in counts], [int(d) for d in displs]
    if not len(counts) == len(displs) == len(types) == size:
        raise ValueError(f"message: expecting {size} counts, displacements and datatypes")
    return byte_view(buf, writable), counts, displs, types


def w_block(view: memoryview, count: int, displ: int, dt: Datatype, writable: bool) -> Msg:
    """One peer's block of an ``Alltoallw`` buffer: ``displ`` counts bytes."""
    if displ < 0:
        raise ValueError(f"message: negative displacement {displ}")
    return _msg(view[displ:], count, 0, dt, count, writable)


def _integral(x: Any) -> bool:
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def block(vm: VMsg, i: int) -> memoryview:
    return _slice(vm.view, vm.counts[i], vm.displs[i], vm.datatype)


def _whole(view: memoryview, dt: Datatype) -> int:
    extent = dt.extent
    if extent <= 0:
        return 0
    count, rest = divmod(view.nbytes, extent)
    if rest:
        raise ValueError(
            f"message: buffer length {view.nbytes} is not a multiple of datatype extent {extent}"
        )
    return count


def _slice(view: memoryview, count: int, displ: int, dt: Datatype) -> memoryview:
    if count < 0:
        raise errors.MPIException(errors.ERR_COUNT)
    start = displ * dt.extent
    end = start + count * dt.extent
    if start == 0 and end == view.nbytes:
        return view
    if end > view.nbytes or start < 0:
        raise ValueError(f"message: buffer too small: {view.nbytes} bytes, {end} needed")
    return view[start:end]
