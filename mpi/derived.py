"""Derived datatypes: type maps as byte segments, and packing of non-contiguous layouts.

A derived datatype keeps the byte segments ``(offset, length)`` of one element, in type-map
order, relative to the element's origin, with MPI's ``lb``/``extent``. Messages always travel
packed: a datatype whose element is not one dense run from offset 0 with extent equal to size
is gathered into a contiguous payload before sending, and scattered back into the user's
layout after receiving (numpy fancy indexing over the bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vpool.mpi import errors

if TYPE_CHECKING:
    from vpool.mpi.datatypes import Datatype

Segs = tuple[tuple[int, int], ...]


def segs_of(dt: Datatype) -> Segs:
    """Byte segments of one element (predefined types are their whole extent)."""
    segs = dt._segs
    return segs if segs is not None else ((0, dt._extent),)


def _merge(segs: list[tuple[int, int]]) -> Segs:
    out: list[tuple[int, int]] = []
    for off, n in segs:
        if n <= 0:
            continue
        if out and out[-1][0] + out[-1][1] == off:
            out[-1] = (out[-1][0], out[-1][1] + n)
        else:
            out.append((off, n))
    return tuple(out)


def _check(dt: Datatype) -> None:
    if not dt:
        raise errors.MPIException(errors.ERR_TYPE, "null datatype")


def _count(n: Any) -> int:
    n = int(n)
    if n < 0:
        raise errors.MPIException(errors.ERR_COUNT, f"invalid count {n}")
    return n


def build(blocks: Sequence[tuple[int, int, Datatype]]) -> Datatype:
    """The datatype of ``(byte displacement, count, type)`` blocks, in type-map order."""
    from vpool.mpi.datatypes import Datatype

    segs: list[tuple[int, int]] = []
    lb: int | None = None
    ub: int | None = None
    bases = set()
    for disp, count, old in blocks:
        _check(old)
        count = _count(count)
        if count == 0:
            continue
        osegs = segs_of(old)
        if len(osegs) == 1 and osegs[0][1] == old._extent:
            # Dense copies abut: one segment, however large the count (no loop per element).
            segs.append((disp + osegs[0][0], count * old._extent))
        else:
            for k in range(count):
                d = disp + k * old._extent
                segs.extend((d + off, n) for off, n in osegs)
        lo = disp + old._lb
        hi = disp + (count - 1) * old._extent + old._lb + old._extent
        lb = lo if lb is None else min(lb, lo)
        ub = hi if ub is None else max(ub, hi)
        bases.add(old._base or old)
    merged = _merge(segs)
    size = sum(n for _, n in merged)
    base = bases.pop() if len(bases) == 1 else None
    if base is not None and base._code is None and base._name not in _pair_names():
        base = None
    dt = Datatype(
        name="",
        size=size,
        code=None,
        base=base,
        count=(size // base._size) if base is not None and base._size else 1,
        lb=lb or 0,
        extent=(ub or 0) - (lb or 0),
    )
    dt._segs = merged
    return dt


def _pair_names() -> Any:
    from vpool.mpi.datatypes import _PAIR_NAMES

    return _PAIR_NAMES


def resized(old: Datatype, lb: int, extent: int) -> Datatype:
    _check(old)
    dt = build([(0, 1, old)])
    dt._lb, dt._extent = int(lb), int(extent)
    return dt


def packed(dt: Datatype) -> bool:
    """Whether a message of ``dt`` differs from the bytes of its buffer region."""
    segs = dt._segs
    if segs is None:
        return False
    return not (dt._lb == 0 and dt._extent == dt._size and segs in (((0, dt._size),), ()))


def wire_size(dt: Datatype) -> int:
    """Bytes one element takes in a message."""
    return dt._size if packed(dt) else dt._extent


def span(dt: Datatype, count: int) -> int:
    """Bytes of the buffer region ``count`` elements reach, from the buffer's start."""
    if count <= 0:
        return 0
    segs = segs_of(dt)
    hi = max((off + n for off, n in segs), default=0)
    lo = min((off for off, _ in segs), default=0)
    if lo < 0:
        raise errors.MPIException(errors.ERR_TYPE, "datatypes with negative offsets")
    return (count - 1) * dt._extent + hi


def _index(dt: Datatype, count: int) -> Any:
    import numpy as np

    one = np.concatenate(
        [np.arange(off, off + n, dtype=np.intp) for off, n in segs_of(dt)]
        or [np.empty(0, dtype=np.intp)]
    )
    steps = np.arange(count, dtype=np.intp) * dt._extent
    return (steps[:, None] + one[None, :]).ravel()


def pack(region: memoryview, dt: Datatype, count: int) -> memoryview:
    """The packed bytes of ``count`` elements laid out in ``region`` (a flat byte view)."""
    import numpy as np

    src = np.frombuffer(region, dtype=np.uint8)
    out = bytearray(count * dt._size)
    if out:
        np.frombuffer(out, dtype=np.uint8)[:] = src[_index(dt, count)]
    return memoryview(out)


def unpack(data: memoryview, region: memoryview, dt: Datatype, count: int) -> None:
    """Scatter packed ``data`` back into ``region`` (the inverse of ``pack``)."""
    import numpy as np

    if not data.nbytes:
        return
    dst = np.frombuffer(region, dtype=np.uint8)
    dst[_index(dt, count)] = np.frombuffer(data, dtype=np.uint8)


def address(obj: Any) -> int:
    """``MPI.Get_address``: the memory address of a buffer (or an address passed through)."""
    import operator

    try:
        return operator.index(obj)
    except TypeError:
        pass
    from vpool.mpi.buffers import BOTTOM

    if obj is None or obj is BOTTOM:
        return 0
    import numpy as np

    mv = obj if isinstance(obj, memoryview) else memoryview(obj)
    if mv.nbytes == 0:
        return 0
    arr = np.frombuffer(mv.cast("B") if mv.c_contiguous else mv.tobytes(), dtype=np.uint8)
    return int(arr.ctypes.data)


def count_arg(n: Any) -> int:
    return _count(n)


def zip_args(blocklengths: Any, displacements: Any) -> list[tuple[int, int]]:
    bl, dl = list(blocklengths), list(displacements)
    if len(bl) != len(dl):
        raise ValueError("mismatch in blocklengths and displacements")
    return [(_count(b), int(d)) for b, d in zip(bl, dl, strict=True)]
