"""The type-code tables of predefined datatypes (mpi4py's ``MPI._typedict``, ``_typedict_c``,
``_typedict_f``), and the datatype of a buffer's format or of a type code string.
"""

from __future__ import annotations

from vpool.mpi import errors
from vpool.mpi.datatypes import (
    AINT,
    BYTE,
    C_BOOL,
    C_DOUBLE_COMPLEX,
    C_FLOAT_COMPLEX,
    C_LONG_DOUBLE_COMPLEX,
    CHAR,
    COMPLEX,
    COMPLEX8,
    COMPLEX16,
    COMPLEX32,
    COUNT,
    DOUBLE,
    DOUBLE_COMPLEX,
    DOUBLE_PRECISION,
    FLOAT,
    FLOAT16_T,
    INT,
    INT8_T,
    INT16_T,
    INT32_T,
    INT64_T,
    INTEGER,
    INTEGER1,
    INTEGER2,
    INTEGER4,
    INTEGER8,
    LOGICAL,
    LONG,
    LONG_DOUBLE,
    LONG_LONG,
    REAL,
    REAL4,
    REAL8,
    REAL16,
    SHORT,
    SIGNED_CHAR,
    UINT8_T,
    UINT16_T,
    UINT32_T,
    UINT64_T,
    UNSIGNED,
    UNSIGNED_CHAR,
    UNSIGNED_LONG,
    UNSIGNED_LONG_LONG,
    UNSIGNED_SHORT,
    WCHAR,
    Datatype,
)

# mpi4py's MPI._typedict: numpy/struct type characters -> datatype.
typedict: dict[str, Datatype] = {
    "?": C_BOOL,
    "c": CHAR,
    "b": SIGNED_CHAR,
    "h": SHORT,
    "i": INT,
    "l": LONG,
    "q": LONG_LONG,
    "p": AINT,
    "B": UNSIGNED_CHAR,
    "H": UNSIGNED_SHORT,
    "I": UNSIGNED,
    "L": UNSIGNED_LONG,
    "Q": UNSIGNED_LONG_LONG,
    "f": FLOAT,
    "d": DOUBLE,
    "g": LONG_DOUBLE,
    "F": C_FLOAT_COMPLEX,
    "D": C_DOUBLE_COMPLEX,
    "G": C_LONG_DOUBLE_COMPLEX,
    "U": WCHAR,
    "b1": C_BOOL,
    "i1": INT8_T,
    "i2": INT16_T,
    "i4": INT32_T,
    "i8": INT64_T,
    "u1": UINT8_T,
    "u2": UINT16_T,
    "u4": UINT32_T,
    "u8": UINT64_T,
    "f4": FLOAT,
    "f8": DOUBLE,
    "c8": C_FLOAT_COMPLEX,
    "c16": C_DOUBLE_COMPLEX,
}
typedict_c = dict(typedict)
typedict_f: dict[str, Datatype] = {
    "l": LOGICAL,
    "i": INTEGER,
    "r": REAL,
    "s": REAL,
    "d": DOUBLE_PRECISION,
    "c": COMPLEX,
    "z": DOUBLE_COMPLEX,
}

# Buffer-protocol format strings -> datatype, for buffers passed without a datatype.
_FORMATS: dict[str, Datatype] = {**typedict, "B": BYTE, "Zf": C_FLOAT_COMPLEX}
_FORMATS |= {"Zd": C_DOUBLE_COMPLEX, "Zg": C_LONG_DOUBLE_COMPLEX}

# The rest of mpi4py's ``_typedict`` keys (``Datatype.fromcode``); after ``_FORMATS`` so that
# buffer formats keep their meaning (a ``'u'`` array holds wchar_t, not uint16).
typedict |= {"e": FLOAT16_T, "f2": FLOAT16_T, "f16": LONG_DOUBLE, "c32": C_LONG_DOUBLE_COMPLEX}
typedict |= {"Zf": C_FLOAT_COMPLEX, "Zd": C_DOUBLE_COMPLEX, "Zg": C_LONG_DOUBLE_COMPLEX}
typedict |= {"n": COUNT, "N": UNSIGNED_LONG, "P": UNSIGNED_LONG}
typedict |= dict.fromkeys(("a", "S", "S1", "s", "1s"), CHAR)
typedict |= dict.fromkeys(("U1", "w", "1w"), WCHAR) | {"u": UINT16_T, "1u": UINT16_T}
typedict |= dict.fromkeys(("M", "M8", "m", "m8"), INT64_T)
typedict_c |= {"f2": FLOAT16_T, "f16": LONG_DOUBLE, "c32": C_LONG_DOUBLE_COMPLEX}
typedict_f |= {"i1": INTEGER1, "i2": INTEGER2, "i4": INTEGER4, "i8": INTEGER8}
typedict_f |= {"r4": REAL4, "r8": REAL8, "r16": REAL16}
typedict_f |= {"c8": COMPLEX8, "c16": COMPLEX16, "c32": COMPLEX32}


def from_format(fmt: str) -> Datatype:
    """Datatype for a memoryview format; unknown ones (structs) travel as bytes."""
    dt = _FORMATS.get(fmt)
    if dt is None:
        dt = _FORMATS.get(fmt.lstrip("@=<>!"))
    return dt if dt is not None else BYTE


def lookup(spec: Datatype | str) -> Datatype:
    """A datatype from a Datatype or a type code string such as ``"d"`` or ``"i4"``."""
    if isinstance(spec, Datatype):
        return spec
    if isinstance(spec, str):
        import numpy as np

        try:
            code = np.dtype(spec).char
        except TypeError as exc:
            raise errors.MPIException(errors.ERR_TYPE, f"unknown type code {spec!r}") from exc
        dt = typedict.get(code) or typedict.get(spec)
        if dt is None:
            raise errors.MPIException(errors.ERR_TYPE, f"unknown type code {spec!r}")
        return dt
    raise TypeError(f"expected a datatype, got {type(spec).__name__}")
