"""``Datatype.Pack``/``Unpack``/``Pack_size`` and their ``_external`` variants, as mpi4py 4.1.

As in mpi4py, ``inbuf`` of ``Pack`` and ``outbuf`` of ``Unpack`` are plain buffers holding
``len // extent`` elements of the datatype; the packed side is a byte buffer and a position in
it. The native packing is the datatype's packed bytes (no header: ``Pack_size(0)`` is 0, as in
MPICH). ``"external32"`` is big-endian with MPICH's sizes (``long``/``unsigned long`` are 4
bytes, ``wchar_t`` 2); long doubles are byte-swapped, not converted to IEEE quad.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from vpool.mpi import derived, errors

if TYPE_CHECKING:
    from vpool.mpi.datatypes import Datatype

EXTERNAL32 = "external32"
_LITTLE = sys.byteorder == "little"

# A primitive of an element: (byte offset, native size, external32 size, kind), kind one of
# "b" (bytes as they are), "i"/"u" (signed/unsigned integer), "f" (one float), "c" (complex).
Prim = tuple[int, int, int, str]

_EXT_SIZE = {"MPI_LONG": 4, "MPI_UNSIGNED_LONG": 4, "MPI_WCHAR": 2}


def _check(dt: Datatype) -> None:
    if not dt:
        raise errors.MPIException(errors.ERR_TYPE, "null datatype")


def _datarep(datarep: Any) -> None:
    if str(datarep) != EXTERNAL32:
        raise errors.MPIException(errors.ERR_ARG, f"unsupported data representation {datarep!r}")


def _kind(code: str) -> str:
    if code in ("?", "c", "b1", "S1"):
        return "b"
    if code in ("F", "D", "G") or code.startswith("c"):
        return "c"
    if code in ("e", "f", "d", "g") or code.startswith("f"):
        return "f"
    if code in ("B", "H", "I", "L", "Q", "U") or code.startswith("u"):
        return "u"
    return "i"


def _prims(dt: Datatype) -> list[Prim]:
    """The primitives of one element of a predefined datatype."""
    from vpool.mpi.datatypes import _PAIR_NAMES, _PAIRS, _numpy_size

    name = dt._name
    if name in _PAIR_NAMES:
        key = _PAIR_NAMES[name]
        vcode, _ = _PAIRS[key]
        vsize = _numpy_size(vcode)
        ioff = -(-vsize // 4) * 4
        return [(0, vsize, vsize, _kind(vcode)), (ioff, 4, 4, "i")]
    code = dt._code
    if code is None:
        raise NotImplementedError(f"external32 packing of {name or 'this datatype'}")
    size = dt._size
    return [(0, size, _EXT_SIZE.get(name, size), _kind(code))]


def _layout(dt: Datatype) -> tuple[list[Prim], int, int]:
    """(primitives of one base element, native bytes of one, base elements per ``dt``)."""
    if dt._segs is None:
        prims = _prims(dt)
        return prims, dt._extent, 1
    base = dt._base
    if base is None:
        raise NotImplementedError("external32 packing of a datatype mixing several base types")
    per = dt._size // base._extent if base._extent else 0
    return _prims(base), base._extent, per


def _ext_size(prims: list[Prim]) -> int:
    return sum(e for _, _, e, _ in prims)


def pack_size(dt: Datatype, count: int, datarep: Any) -> int:
    _check(dt)
    count = int(count)
    if count < 0:
        raise errors.MPIException(errors.ERR_COUNT, f"invalid count {count}")
    if datarep is None:
        return count * dt._size
    _datarep(datarep)
    prims, _, per = _layout(dt)
    return count * per * _ext_size(prims)


def _native(dt: Datatype, ibuf: memoryview) -> tuple[memoryview, int]:
    """The packed native bytes of the elements ``ibuf`` holds, and their count."""
    extent = dt._extent
    count = ibuf.nbytes // extent if extent > 0 else 0
    if derived.packed(dt):
        if count and derived.span(dt, count) > ibuf.nbytes:
            count -= 1
        return derived.pack(ibuf, dt, count), count
    return ibuf[: count * dt._size], count


def _swap(a: Any) -> Any:
    return a[:, ::-1] if _LITTLE else a


def _to_ext(data: memoryview, prims: list[Prim], nsize: int) -> bytes:
    import numpy as np

    n = data.nbytes // nsize if nsize else 0
    src = np.frombuffer(data, dtype=np.uint8)[: n * nsize].reshape(n, nsize)
    cols = []
    for off, nsz, esz, kind in prims:
        col = src[:, off : off + nsz]
        if kind == "b" or nsz == 1:
            cols.append(col)
        elif kind == "c":
            half = nsz // 2
            cols += [_swap(col[:, :half]), _swap(col[:, half:])]
        elif esz < nsz:
            low = col[:, :esz] if _LITTLE else col[:, nsz - esz :]
            cols.append(_swap(low))
        else:
            cols.append(_swap(col))
    return np.ascontiguousarray(np.concatenate(cols, axis=1)).tobytes() if cols else b""


def _from_ext(data: memoryview, prims: list[Prim], nsize: int) -> bytearray:
    import numpy as np

    esize = _ext_size(prims)
    n = data.nbytes // esize if esize else 0
    src = np.frombuffer(data, dtype=np.uint8)[: n * esize].reshape(n, esize)
    out = np.zeros((n, nsize), dtype=np.uint8)
    pos = 0
    for off, nsz, esz, kind in prims:
        col = src[:, pos : pos + esz]
        pos += esz
        dst = out[:, off : off + nsz]
        if kind == "b" or nsz == 1:
            dst[:] = col
        elif kind == "c":
            half = nsz // 2
            dst[:, :half] = _swap(col[:, :half])
            dst[:, half:] = _swap(col[:, half:])
        elif esz < nsz:
            # Widen: the value's bytes, then sign (or zero) extension.
            neg = col[:, 0] >= 0x80 if kind == "i" else np.zeros(n, dtype=bool)
            ext = np.where(neg, 0xFF, 0).astype(np.uint8).reshape(-1, 1)
            if _LITTLE:
                dst[:, :esz] = col[:, ::-1]
                dst[:, esz:] = ext
            else:
                dst[:, nsz - esz :] = col
                dst[:, : nsz - esz] = ext
        else:
            dst[:] = _swap(col)
    return bytearray(out.tobytes())


def _position(position: Any, limit: int) -> int:
    pos = int(position)
    if pos < 0 or pos > limit:
        raise errors.MPIException(errors.ERR_ARG, f"invalid position {pos}")
    return pos


def pack(dt: Datatype, inbuf: Any, outbuf: Any, position: int, datarep: Any) -> int:
    from vpool.mpi.buffers import byte_view

    _check(dt)
    if datarep is not None:
        _datarep(datarep)
    ibuf = byte_view(inbuf, False)
    obuf = byte_view(outbuf, True)
    pos = _position(position, obuf.nbytes)
    data, _ = _native(dt, ibuf)
    if datarep is not None:
        prims, nsize, _ = _layout(dt)
        data = memoryview(_to_ext(data, prims, nsize))
    end = pos + data.nbytes
    if end > obuf.nbytes:
        raise errors.MPIException(errors.ERR_TRUNCATE, "output buffer too small to pack")
    obuf[pos:end] = data
    return end


def unpack(dt: Datatype, inbuf: Any, position: int, outbuf: Any, datarep: Any) -> int:
    from vpool.mpi.buffers import byte_view

    _check(dt)
    if datarep is not None:
        _datarep(datarep)
    ibuf = byte_view(inbuf, False)
    obuf = byte_view(outbuf, True)
    pos = _position(position, ibuf.nbytes)
    extent = dt._extent
    count = obuf.nbytes // extent if extent > 0 else 0
    if count and derived.packed(dt) and derived.span(dt, count) > obuf.nbytes:
        count -= 1
    nbytes = pack_size(dt, count, datarep)
    end = pos + nbytes
    if end > ibuf.nbytes:
        raise errors.MPIException(errors.ERR_TRUNCATE, "input buffer too small to unpack")
    data = ibuf[pos:end]
    if datarep is not None:
        prims, nsize, _ = _layout(dt)
        data = memoryview(_from_ext(data, prims, nsize))
    if derived.packed(dt):
        derived.unpack(data, obuf, dt, count)
    else:
        obuf[: data.nbytes] = data
    return end
