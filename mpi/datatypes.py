"""MPI datatypes: sizes and extents for buffer specs, numpy dtypes for reductions.

Messages travel as raw bytes, so a datatype only matters for counting (``Get_count``, buffer
specs with counts and displacements) and for applying reduction operations, which are done with
numpy on views of the buffers. numpy is imported lazily: most programs never reduce a buffer, and
startup time of rank processes counts.
"""

from __future__ import annotations

import struct
from typing import Any

from vpool.mpi import derived, envelope, errors, pack, typecodes

# Pair types of MAXLOC/MINLOC, as C lays out ``struct {T value; int index;}``.
_PAIRS = {
    "FLOAT_INT": ("f4", "i4"),
    "DOUBLE_INT": ("f8", "i4"),
    "LONG_INT": ("i8", "i4"),
    "2INT": ("i4", "i4"),
    "SHORT_INT": ("i2", "i4"),
    "LONG_DOUBLE_INT": ("g", "i4"),
}


class Datatype:
    """An MPI datatype. Predefined ones have a numpy type code; contiguous derived ones keep
    their base type and multiplicity so reductions still apply."""

    __slots__ = (
        "_attrs",
        "_base",
        "_code",
        "_committed",
        "_count",
        "_env",
        "_extent",
        "_lb",
        "_name",
        "_segs",
        "_size",
    )

    def __init__(
        self,
        datatype: Datatype | None = None,
        *,
        name: str = "",
        size: int = 0,
        code: str | None = None,
        base: Datatype | None = None,
        count: int = 1,
        lb: int = 0,
        extent: int | None = None,
    ) -> None:
        if datatype is not None:
            # mpi4py's Datatype(datatype) copy constructor: same handle.
            self._name, self._size, self._code = datatype._name, datatype._size, datatype._code
            self._base, self._count = datatype._base, datatype._count
            self._lb, self._extent = datatype._lb, datatype._extent
            self._committed = datatype._committed
            self._segs = datatype._segs
            self._attrs = datatype._attrs
            self._env = datatype._env
            return
        self._name = name
        self._size = size
        self._code = code
        self._base = base
        self._count = count
        self._lb = lb
        self._extent = size if extent is None else extent
        self._committed = True
        self._segs: tuple[tuple[int, int], ...] | None = None  # see ``derived``
        self._attrs: dict[int, Any] | None = None  # user attributes, by keyval
        self._env: envelope.Env | None = None  # how a derived datatype was built

    # ---- properties as in mpi4py ----
    def Get_size(self) -> int:
        return self._size

    @property
    def size(self) -> int:
        return self._size

    def Get_extent(self) -> tuple[int, int]:
        return (self._lb, self._extent)

    @property
    def extent(self) -> int:
        return self._extent

    @property
    def lb(self) -> int:
        return self._lb

    @property
    def ub(self) -> int:
        return self._lb + self._extent

    def Get_true_extent(self) -> tuple[int, int]:
        segs = derived.segs_of(self)
        if not segs:
            return (0, 0)
        lo = min(off for off, _ in segs)
        return (lo, max(off + n for off, n in segs) - lo)

    @property
    def true_extent(self) -> int:
        return self.Get_true_extent()[1]

    @property
    def true_lb(self) -> int:
        return self.Get_true_extent()[0]

    @property
    def true_ub(self) -> int:
        lb, extent = self.Get_true_extent()
        return lb + extent

    def Get_name(self) -> str:
        return self._name

    def Set_name(self, name: str) -> None:
        self._name = name

    @property
    def name(self) -> str:
        return self._name

    @name.setter
    def name(self, value: str) -> None:
        self._name = value

    @property
    def is_predefined(self) -> bool:
        return self._segs is None and self._env is None

    @property
    def is_named(self) -> bool:
        return self.is_predefined

    # ---- type codes (``typecodes``) and packing (``pack``) ----
    @classmethod
    def fromcode(cls, code: str) -> Datatype:
        return typecodes.fromcode(code)

    def tocode(self) -> str:
        return typecodes.tocode(self)

    @property
    def typestr(self) -> str:
        return typecodes.typestr(self)

    @property
    def typechar(self) -> str:
        return typecodes.typechar(self)

    def Pack(self, inbuf: Any, outbuf: Any, position: int, comm: Any) -> int:
        return pack.pack(self, inbuf, outbuf, position, None)

    def Unpack(self, inbuf: Any, position: int, outbuf: Any, comm: Any) -> int:
        return pack.unpack(self, inbuf, position, outbuf, None)

    def Pack_size(self, count: int, comm: Any) -> int:
        return pack.pack_size(self, count, None)

    def Pack_external(self, datarep: str, inbuf: Any, outbuf: Any, position: int) -> int:
        return pack.pack(self, inbuf, outbuf, position, datarep)

    def Unpack_external(self, datarep: str, inbuf: Any, position: int, outbuf: Any) -> int:
        return pack.unpack(self, inbuf, position, outbuf, datarep)

    def Pack_external_size(self, datarep: str, count: int) -> int:
        return pack.pack_size(self, count, datarep)

    def _check(self) -> None:
        if not self:
            raise errors.MPIException(errors.ERR_TYPE, "null datatype")

    def Commit(self) -> Datatype:
        self._check()
        self._committed = True
        return self

    def Free(self) -> None:
        self._check()
        if self.is_predefined:
            raise errors.MPIException(errors.ERR_TYPE, "cannot free a predefined datatype")
        self._become_null()

    def free(self) -> None:
        if self and not self.is_predefined:
            self._become_null()

    def _become_null(self) -> None:
        null = DATATYPE_NULL
        self._name, self._size, self._code = null._name, 0, None
        self._base, self._count, self._lb, self._extent = None, 1, 0, 0
        self._segs = None
        self._env = None

    def Dup(self) -> Datatype:
        self._check()
        return envelope.record(Datatype(self), "DUP", self)

    def Get_attr(self, keyval: int) -> Any:
        self._check()
        from vpool.mpi.constants import KEYVAL_INVALID

        if keyval == KEYVAL_INVALID:
            raise errors.MPIException(errors.ERR_KEYVAL, "invalid keyval")
        return (self._attrs or {}).get(keyval)

    def Set_attr(self, keyval: int, attrval: Any) -> None:
        self._check()
        if self._attrs is None:
            self._attrs = {}
        self._attrs[keyval] = attrval

    def Delete_attr(self, keyval: int) -> None:
        self._check()
        if self._attrs is not None:
            self._attrs.pop(keyval, None)

    @classmethod
    def Create_keyval(
        cls, copy_fn: Any = None, delete_fn: Any = None, nopython: bool = False
    ) -> int:
        from vpool.mpi.commattr import CommAttributes

        return CommAttributes.Create_keyval(copy_fn, delete_fn, nopython)

    @classmethod
    def Free_keyval(cls, keyval: int) -> int:
        from vpool.mpi.constants import KEYVAL_INVALID

        return KEYVAL_INVALID

    # ---- constructors of derived datatypes (``derived``) ----
    def Create_contiguous(self, count: int) -> Datatype:
        return envelope.record(derived.build([(0, count, self)]), "CONTIGUOUS", self, count=count)

    def Create_vector(self, count: int, blocklength: int, stride: int) -> Datatype:
        ext = self._extent
        n = derived.count_arg(count)
        dt = derived.build([(i * stride * ext, blocklength, self) for i in range(n)])
        return envelope.record(
            dt, "VECTOR", self, count=count, blocklength=blocklength, stride=stride
        )

    def Create_hvector(self, count: int, blocklength: int, stride: int) -> Datatype:
        n = derived.count_arg(count)
        dt = derived.build([(i * stride, blocklength, self) for i in range(n)])
        return envelope.record(
            dt, "HVECTOR", self, count=count, blocklength=blocklength, stride=stride
        )

    def Create_indexed(self, blocklengths: Any, displacements: Any) -> Datatype:
        ext = self._extent
        pairs = derived.zip_args(blocklengths, displacements)
        dt = derived.build([(d * ext, b, self) for b, d in pairs])
        return envelope.record(
            dt,
            "INDEXED",
            self,
            blocklengths=[b for b, _ in pairs],
            displacements=[d for _, d in pairs],
        )

    def Create_hindexed(self, blocklengths: Any, displacements: Any) -> Datatype:
        pairs = derived.zip_args(blocklengths, displacements)
        dt = derived.build([(d, b, self) for b, d in pairs])
        return envelope.record(
            dt,
            "HINDEXED",
            self,
            blocklengths=[b for b, _ in pairs],
            displacements=[d for _, d in pairs],
        )

    def Create_indexed_block(self, blocklength: int, displacements: Any) -> Datatype:
        ext = self._extent
        displs = [int(d) for d in displacements]
        dt = derived.build([(d * ext, blocklength, self) for d in displs])
        return envelope.record(
            dt, "INDEXED_BLOCK", self, blocklength=blocklength, displacements=displs
        )

    def Create_hindexed_block(self, blocklength: int, displacements: Any) -> Datatype:
        displs = [int(d) for d in displacements]
        dt = derived.build([(d, blocklength, self) for d in displs])
        return envelope.record(
            dt, "HINDEXED_BLOCK", self, blocklength=blocklength, displacements=displs
        )

    @classmethod
    def Create_struct(cls, blocklengths: Any, displacements: Any, datatypes: Any) -> Datatype:
        types = list(datatypes)
        pairs = derived.zip_args(blocklengths, displacements)
        if len(types) != len(pairs):
            raise ValueError("mismatch in blocklengths and datatypes")
        dt = derived.build([(d, b, t) for (b, d), t in zip(pairs, types, strict=True)])
        envelope.pad_struct(dt, types)
        return envelope.record(
            dt,
            "STRUCT",
            types,
            blocklengths=[b for b, _ in pairs],
            displacements=[d for _, d in pairs],
        )

    def Create_subarray(self, sizes: Any, subsizes: Any, starts: Any, order: int = 56) -> Datatype:
        dt = envelope.subarray(self, sizes, subsizes, starts, order)
        return envelope.record(
            dt,
            "SUBARRAY",
            self,
            sizes=[int(n) for n in sizes],
            subsizes=[int(n) for n in subsizes],
            starts=[int(n) for n in starts],
            order=order,
        )

    @classmethod
    def Get_value_index(cls, value: Datatype, index: Datatype) -> Datatype:
        """The MINLOC/MAXLOC pair type of ``value`` and ``index`` (MPICH has ``T,int``)."""
        value._check()
        index._check()
        if index == INT:
            for name, values in _PAIR_VALUES.items():
                if value in values:
                    return _BY_NAME[f"MPI_{name}"]
        return DATATYPE_NULL

    # ---- decoding (``envelope``) ----
    @property
    def combiner(self) -> int:
        return envelope.combiner(self)

    def decode(self) -> tuple[Any, str, dict[str, Any]]:
        return envelope.decode(self)

    def Get_envelope(self) -> tuple[int, int, int, int, int]:
        return envelope.envelope(self)

    @property
    def envelope(self) -> tuple[int, int, int, int, int]:
        return envelope.envelope(self)

    def Get_contents(self) -> tuple[list[int], list[int], list[int], list[Datatype]]:
        return envelope.contents(self)

    @property
    def contents(self) -> tuple[list[int], list[int], list[int], list[Datatype]]:
        return envelope.contents(self)

    def Create_resized(self, lb: int, extent: int) -> Datatype:
        dt = derived.resized(self, lb, extent)
        return envelope.record(dt, "RESIZED", self, lb=int(lb), extent=int(extent))

    def numpy_dtype(self) -> Any:
        """numpy dtype of one element of the base type (for reductions)."""
        import numpy as np

        base = self._base or self
        if base._name in _PAIR_NAMES:
            value, index = _PAIRS[_PAIR_NAMES[base._name]]
            return np.dtype([("v", value), ("i", index)], align=True)
        if base._code is None:
            raise errors.MPIException(errors.ERR_TYPE, "datatype cannot be reduced")
        return np.dtype(base._code)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Datatype):
            return NotImplemented
        return self is other or (
            self._name == other._name
            and self._size == other._size
            and self._code == other._code
            and self._base is other._base
            and self._count == other._count
            and self._extent == other._extent
            and self._lb == other._lb
            and self._segs == other._segs
        )

    def __hash__(self) -> int:
        return hash((self._name, self._size, self._code))

    def __bool__(self) -> bool:
        return self._name != "MPI_DATATYPE_NULL"

    def __repr__(self) -> str:
        return f"<mpi4py.MPI.Datatype {self._name or '(derived)'}>"

    def __reduce__(self) -> Any:
        if self._name in _BY_NAME:
            return (_by_name, (self._name,))
        return (Datatype, (None,), None)


_PAIR_NAMES = {f"MPI_{k}": k for k in _PAIRS}
_PAIR_VALUES: dict[str, tuple[Datatype, ...]] = {}
_BY_NAME: dict[str, Datatype] = {}


def _by_name(name: str) -> Datatype:
    return _BY_NAME[name]


def _native(code: str) -> int:
    return struct.calcsize(code) if code not in ("g", "G") else (16 if code == "g" else 32)


def _make(
    name: str, code: str | None, size: int | None = None, extent: int | None = None
) -> Datatype:
    if size is None:
        assert code is not None
        size = _numpy_size(code)
    dt = Datatype(name=name, size=size, code=code, extent=extent)
    _BY_NAME[name] = dt
    return dt


def _numpy_size(code: str) -> int:
    sizes = {"i1": 1, "i2": 2, "i4": 4, "i8": 8, "u1": 1, "u2": 2, "u4": 4, "u8": 8}
    sizes |= {"f2": 2, "f4": 4, "f8": 8, "c8": 8, "c16": 16, "F": 8, "D": 16, "G": 32, "U": 4}
    if code in sizes:
        return sizes[code]
    return _native(code)


DATATYPE_NULL = Datatype(name="MPI_DATATYPE_NULL", size=0, code=None)
PACKED = _make("MPI_PACKED", "B", 1)
BYTE = _make("MPI_BYTE", "B", 1)
AINT = _make("MPI_AINT", "q")
OFFSET = _make("MPI_OFFSET", "q")
COUNT = _make("MPI_COUNT", "q")
CHAR = _make("MPI_CHAR", "c", 1)
WCHAR = _make("MPI_WCHAR", "U", 4)
SIGNED_CHAR = _make("MPI_SIGNED_CHAR", "b")
SHORT = _make("MPI_SHORT", "h")
INT = _make("MPI_INT", "i")
LONG = _make("MPI_LONG", "l")
LONG_LONG = _make("MPI_LONG_LONG_INT", "q")
UNSIGNED_CHAR = _make("MPI_UNSIGNED_CHAR", "B")
UNSIGNED_SHORT = _make("MPI_UNSIGNED_SHORT", "H")
UNSIGNED = _make("MPI_UNSIGNED", "I")
UNSIGNED_LONG = _make("MPI_UNSIGNED_LONG", "L")
UNSIGNED_LONG_LONG = _make("MPI_UNSIGNED_LONG_LONG", "Q")
FLOAT = _make("MPI_FLOAT", "f")
DOUBLE = _make("MPI_DOUBLE", "d")
LONG_DOUBLE = _make("MPI_LONG_DOUBLE", "g", 16)
C_BOOL = _make("MPI_C_BOOL", "?", 1)
INT8_T = _make("MPI_INT8_T", "i1")
INT16_T = _make("MPI_INT16_T", "i2")
INT32_T = _make("MPI_INT32_T", "i4")
INT64_T = _make("MPI_INT64_T", "i8")
UINT8_T = _make("MPI_UINT8_T", "u1")
UINT16_T = _make("MPI_UINT16_T", "u2")
UINT32_T = _make("MPI_UINT32_T", "u4")
UINT64_T = _make("MPI_UINT64_T", "u8")
C_COMPLEX = _make("MPI_C_COMPLEX", "F", 8)
C_FLOAT_COMPLEX = C_COMPLEX
C_DOUBLE_COMPLEX = _make("MPI_C_DOUBLE_COMPLEX", "D", 16)
C_LONG_DOUBLE_COMPLEX = _make("MPI_C_LONG_DOUBLE_COMPLEX", "G", 32)
CXX_BOOL = _make("MPI_CXX_BOOL", "?", 1)
CXX_FLOAT_COMPLEX = _make("MPI_CXX_FLOAT_COMPLEX", "F", 8)
CXX_DOUBLE_COMPLEX = _make("MPI_CXX_DOUBLE_COMPLEX", "D", 16)
CXX_LONG_DOUBLE_COMPLEX = _make("MPI_CXX_LONG_DOUBLE_COMPLEX", "G", 32)
# Size counts the data only, extent the C struct with its padding (what a buffer holds).
SHORT_INT = _make("MPI_SHORT_INT", None, 6, 8)
TWOINT = _make("MPI_2INT", None, 8)
INT_INT = TWOINT
LONG_INT = _make("MPI_LONG_INT", None, 12, 16)
FLOAT_INT = _make("MPI_FLOAT_INT", None, 8)
DOUBLE_INT = _make("MPI_DOUBLE_INT", None, 12, 16)
LONG_DOUBLE_INT = _make("MPI_LONG_DOUBLE_INT", None, 20, 32)
# Fortran types, as MPICH maps them on this platform.
CHARACTER = _make("MPI_CHARACTER", "c", 1)
LOGICAL = _make("MPI_LOGICAL", "i4", 4)
INTEGER = _make("MPI_INTEGER", "i4", 4)
REAL = _make("MPI_REAL", "f4", 4)
DOUBLE_PRECISION = _make("MPI_DOUBLE_PRECISION", "f8", 8)
COMPLEX = _make("MPI_COMPLEX", "c8", 8)
DOUBLE_COMPLEX = _make("MPI_DOUBLE_COMPLEX", "c16", 16)
# Sized Fortran types MPICH provides here; the ones it lacks are null handles, as in mpi4py.
INTEGER1 = _make("MPI_INTEGER1", "i1")
INTEGER2 = _make("MPI_INTEGER2", "i2")
INTEGER4 = _make("MPI_INTEGER4", "i4")
INTEGER8 = _make("MPI_INTEGER8", "i8")
REAL4 = _make("MPI_REAL4", "f4")
REAL8 = _make("MPI_REAL8", "f8")
REAL16 = _make("MPI_REAL16", "g", 16)
COMPLEX8 = _make("MPI_COMPLEX8", "c8")
COMPLEX16 = _make("MPI_COMPLEX16", "c16")
COMPLEX32 = _make("MPI_COMPLEX32", "G", 32)
FLOAT16_T = _make("MPIX_C_FLOAT16", "f2")
INTEGER16 = REAL2 = COMPLEX4 = BFLOAT16_T = DATATYPE_NULL
LOGICAL1 = LOGICAL2 = LOGICAL4 = LOGICAL8 = LOGICAL16 = DATATYPE_NULL
LB = Datatype(name="MPI_LB", size=0, code=None)
UB = Datatype(name="MPI_UB", size=0, code=None)

_PAIR_VALUES |= {"FLOAT_INT": (FLOAT,), "DOUBLE_INT": (DOUBLE,), "LONG_INT": (LONG,)}
_PAIR_VALUES |= {"2INT": (INT,), "SHORT_INT": (SHORT,), "LONG_DOUBLE_INT": (LONG_DOUBLE,)}

SIGNED_SHORT = SHORT
SIGNED_INT = INT
SIGNED_LONG = LONG
SIGNED_LONG_LONG = LONG_LONG
UNSIGNED_INT = UNSIGNED
LONG_LONG_INT = LONG_LONG
BOOL = C_BOOL
F_BOOL = LOGICAL
F_INT = INTEGER
F_FLOAT = REAL
F_DOUBLE = DOUBLE_PRECISION
F_COMPLEX = COMPLEX
F_FLOAT_COMPLEX = COMPLEX
F_DOUBLE_COMPLEX = DOUBLE_COMPLEX
SINT8_T = INT8_T
SINT16_T = INT16_T
SINT32_T = INT32_T
SINT64_T = INT64_T
FLOAT32_T = FLOAT
FLOAT64_T = DOUBLE
