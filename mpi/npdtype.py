"""``mpi4py.util.dtlib``: conversion between numpy dtypes and MPI datatypes.

Follows mpi4py 4.1's ``dtlib`` (by Lisandro Dalcin, BSD-2-Clause): numpy structs become
``Create_struct`` + ``Create_resized``, sub-arrays ``Create_contiguous``/``Create_subarray``,
and MPI datatypes are decoded (``Datatype.decode``) back into numpy dtypes.
"""

from __future__ import annotations

from typing import Any

from vpool.mpi import constants as C
from vpool.mpi import envelope
from vpool.mpi.datatypes import DATATYPE_NULL, Datatype

try:
    from numpy import dtype as _np_dtype
except ImportError:  # pragma: no cover
    _np_dtype = None

_INDEXED = (C.COMBINER_INDEXED, C.COMBINER_HINDEXED, C.COMBINER_INDEXED_BLOCK)
_INDEXED += (C.COMBINER_HINDEXED_BLOCK,)


def _free(types: Any) -> None:
    for t in types:
        if t and not t.is_predefined:
            t.Free()


def _is_aligned(datatype: Datatype, offset: int = 0) -> bool:
    if datatype.is_predefined:
        if offset == 0:
            return True
        alignment = envelope.typealign(datatype) or 0
        return offset % alignment == 0
    combiner = datatype.combiner
    basetype, _, info = datatype.decode()
    types, disps = [basetype], [0]
    try:
        if combiner == C.COMBINER_RESIZED:
            disps = [info["extent"]]
        if combiner == C.COMBINER_STRUCT:
            types, disps = info["datatypes"], info["displacements"]
        if combiner == C.COMBINER_HVECTOR:
            disps = [info["stride"] if info["count"] > 1 else 0]
        if combiner in (C.COMBINER_HINDEXED, C.COMBINER_HINDEXED_BLOCK):
            disps = info["displacements"]
        return all(_is_aligned(t, offset + d) for t, d in zip(types, disps, strict=False))
    finally:
        _free(types)


def from_numpy_dtype(dtype: Any) -> Datatype:
    """Convert a numpy dtype to an MPI datatype."""
    if _np_dtype is None:
        raise RuntimeError("NumPy is not available") from None
    dtype = _np_dtype(dtype)
    if dtype.hasobject:
        raise ValueError("NumPy datatype with object entries")
    if not dtype.isnative:
        raise ValueError("NumPy datatype with non-native byteorder")
    fields = dtype.fields
    if fields:
        blocklengths, displacements, datatypes = [], [], []
        try:
            for name in dtype.names or ():
                ftype, fdisp, *_ = fields[name]
                blocklengths.append(1)
                displacements.append(fdisp)
                datatypes.append(from_numpy_dtype(ftype))
            datatype = Datatype.Create_struct(blocklengths, displacements, datatypes)
        finally:
            _free(datatypes)
        try:
            return datatype.Create_resized(0, dtype.itemsize)
        finally:
            datatype.Free()
    if dtype.subdtype:
        base, shape = dtype.subdtype
        datatype = from_numpy_dtype(base)
        try:
            if len(shape) == 1:
                return datatype.Create_contiguous(shape[0])
            return datatype.Create_subarray(shape, shape, (0,) * len(shape))
        finally:
            if not datatype.is_predefined:
                datatype.Free()
    return Datatype.fromcode(dtype.char).Dup()


def _np(spec: Any, **kwargs: Any) -> Any:
    if _np_dtype is None:
        return spec if not kwargs else (spec, kwargs)
    return _np_dtype(spec, **kwargs)


def _fields(names_formats: Any, offsets: Any, aligned: bool, itemsize: int | None) -> Any:
    names, formats = names_formats
    spec: dict[str, Any] = {"names": names, "formats": formats, "offsets": offsets}
    if itemsize is not None:
        spec["itemsize"] = itemsize
    spec["aligned"] = aligned
    return _np(spec)


def to_numpy_dtype(datatype: Datatype) -> Any:
    """Convert an MPI datatype to a numpy dtype."""

    def mpi2npy(dt: Datatype, count: int) -> Any:
        dtype = to_numpy_dtype(dt)
        return dtype if count == 1 else (dtype, count)

    if datatype == DATATYPE_NULL:
        raise ValueError("cannot convert null MPI datatype to NumPy")
    combiner = datatype.combiner
    if combiner == C.COMBINER_NAMED:
        typecode = envelope.typecode(datatype)
        if typecode is not None:
            return _np(typecode)
        from vpool.mpi import datatypes as D

        names = ("SHORT", "INT", "LONG", "FLOAT", "DOUBLE", "LONG_DOUBLE")
        pairs = [getattr(D, f"{n}_INT") for n in names]
        if datatype not in pairs:
            raise ValueError("cannot convert MPI datatype to NumPy")
        value = envelope.typecode(getattr(D, names[pairs.index(datatype)]))
        return _np(f"{value},i", align=True)

    basetype, _, info = datatype.decode()
    datatypes = [basetype]
    try:
        if combiner == C.COMBINER_DUP:
            return to_numpy_dtype(basetype)
        if combiner == C.COMBINER_CONTIGUOUS:
            return _np((to_numpy_dtype(basetype), (info["count"],)))
        if combiner == C.COMBINER_SUBARRAY:
            dtype = to_numpy_dtype(basetype)
            sizes, subsizes, starts = info["sizes"], info["subsizes"], info["starts"]
            if subsizes == sizes and min(starts) == max(starts) == 0:
                if info["order"] == envelope.ORDER_FORTRAN:
                    sizes = sizes[::-1]
                return _np((dtype, tuple(sizes)))
            raise ValueError("cannot convert subarray MPI datatype to NumPy")
        aligned = True
        if combiner == C.COMBINER_RESIZED and basetype.combiner == C.COMBINER_STRUCT:
            aligned = _is_aligned(basetype, info["extent"])
            combiner = C.COMBINER_STRUCT
            _, _, info = basetype.decode()
            datatypes.pop().Free()
        if combiner == C.COMBINER_STRUCT:
            datatypes = info["datatypes"]
            offsets = info["displacements"]
            names = [f"f{i}" for i in range(len(datatypes))]
            formats = list(map(mpi2npy, datatypes, info["blocklengths"]))
            aligned &= all(map(_is_aligned, datatypes, offsets))
            return _fields((names, formats), offsets, aligned, datatype.extent)
        if combiner in (C.COMBINER_VECTOR, C.COMBINER_HVECTOR):
            dtype = to_numpy_dtype(basetype)
            count, blocklength, stride = info["count"], info["blocklength"], info["stride"]
            if combiner == C.COMBINER_VECTOR:
                stride *= basetype.extent
                aligned = _is_aligned(basetype)
            else:
                stride = stride if count > 1 else 0
                aligned = _is_aligned(basetype, stride)
            names = [f"f{i}" for i in range(count)]
            formats = [(dtype, (blocklength,))] * count
            offsets = [stride * i for i in range(count)]
            return _fields((names, formats), offsets, aligned, datatype.extent)
        if combiner in _INDEXED:
            dtype = to_numpy_dtype(basetype)
            aligned = _is_aligned(basetype)
            displacements = info["displacements"]
            if combiner in _INDEXED[:2]:
                blocklengths = info["blocklengths"]
            else:
                blocklengths = [info["blocklength"]] * len(displacements)
            stride = basetype.extent if combiner in _INDEXED[0::2] else 1
            if combiner in _INDEXED[1::2]:
                aligned &= all(_is_aligned(basetype, d) for d in displacements)
            names = [f"f{i}" for i in range(len(displacements))]
            formats = [(dtype, (blen,)) for blen in blocklengths]
            offsets = [d * stride for d in displacements]
            return _fields((names, formats), offsets, aligned, None)
        raise ValueError("cannot convert MPI datatype to NumPy")
    finally:
        _free(datatypes)
