"""Type codes of datatypes, as mpi4py has them: ``Datatype.fromcode``, ``tocode``, ``typestr``
and ``typechar``.

The tables follow mpi4py 4.1 built against MPICH on a 64-bit little-endian Linux host (for
instance ``C_BOOL.tocode()`` is ``"b1"`` but ``CXX_BOOL.tocode()`` is ``"?"``, and the Fortran
``LOGICAL`` maps to ``"i"``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vpool.mpi.datatypes import Datatype

# MPI name (without the ``MPI_`` prefix) -> the code ``tocode`` gives.
_CODES: dict[str, str] = {
    "AINT": "p",
    "COUNT": "p",
    "OFFSET": "p",
    "C_BOOL": "b1",
    "CXX_BOOL": "?",
    "BYTE": "B",
    "PACKED": "B",
    "UNSIGNED_CHAR": "B",
    "CHAR": "c",
    "CHARACTER": "c",
    "SIGNED_CHAR": "b",
    "WCHAR": "U",
    "SHORT": "h",
    "INT": "i",
    "LONG": "l",
    "LONG_LONG_INT": "q",
    "UNSIGNED_SHORT": "H",
    "UNSIGNED": "I",
    "UNSIGNED_LONG": "L",
    "UNSIGNED_LONG_LONG": "Q",
    "FLOAT": "f",
    "DOUBLE": "d",
    "LONG_DOUBLE": "g",
    "MPIX_C_FLOAT16": "e",
    "C_COMPLEX": "F",
    "C_DOUBLE_COMPLEX": "D",
    "C_LONG_DOUBLE_COMPLEX": "G",
    "CXX_FLOAT_COMPLEX": "F",
    "CXX_DOUBLE_COMPLEX": "D",
    "CXX_LONG_DOUBLE_COMPLEX": "G",
    "INT8_T": "i1",
    "INT16_T": "i2",
    "INT32_T": "i4",
    "INT64_T": "i8",
    "UINT8_T": "u1",
    "UINT16_T": "u2",
    "UINT32_T": "u4",
    "UINT64_T": "u8",
    "LOGICAL": "i",
    "INTEGER": "i",
    "REAL": "f",
    "DOUBLE_PRECISION": "d",
    "COMPLEX": "F",
    "DOUBLE_COMPLEX": "D",
    "INTEGER1": "i1",
    "INTEGER2": "i2",
    "INTEGER4": "i4",
    "INTEGER8": "i8",
    "REAL4": "f4",
    "REAL8": "f8",
    "REAL16": "f16",
    "COMPLEX8": "c8",
    "COMPLEX16": "c16",
    "COMPLEX32": "c32",
}

# Single-character codes -> type strings (numpy's, without byte order).
_TYPESTR = {
    "?": "b1",
    "c": "S1",
    "U": "U1",
    "b": "i1",
    "h": "i2",
    "i": "i4",
    "l": "i8",
    "q": "i8",
    "p": "i8",
    "B": "u1",
    "H": "u2",
    "I": "u4",
    "L": "u8",
    "Q": "u8",
    "e": "f2",
    "f": "f4",
    "d": "f8",
    "g": "f16",
    "F": "c8",
    "D": "c16",
    "G": "c32",
}
# Sized type strings -> their character code.
_TYPECHAR = {
    "b1": "?",
    "i1": "b",
    "i2": "h",
    "i4": "i",
    "i8": "l",
    "u1": "B",
    "u2": "H",
    "u4": "I",
    "u8": "L",
    "f2": "e",
    "f4": "f",
    "f8": "d",
    "f16": "g",
    "c8": "F",
    "c16": "D",
    "c32": "G",
    "S1": "c",
    "U1": "U",
}


def _code(dt: Datatype) -> str | None:
    if not dt or not dt.is_predefined:
        return None
    name = dt._name
    return _CODES.get(name[4:] if name.startswith("MPI_") else name)


def tocode(dt: Datatype) -> str:
    code = _code(dt)
    if code is None:
        raise ValueError("cannot map to character code or type string")
    return code


def typestr(dt: Datatype) -> str:
    if not dt:
        return ""
    code = _code(dt)
    if code is None:
        return f"V{dt._extent}"
    return _TYPESTR.get(code, code)


def typechar(dt: Datatype) -> str:
    if not dt:
        return ""
    code = _code(dt)
    if code is None:
        return "V"
    return code if len(code) == 1 else _TYPECHAR.get(code, "V")


def fromcode(code: str) -> Datatype:
    from vpool.mpi.typedict import typedict

    found = typedict.get(code) if isinstance(code, str) else None
    if found is None:
        raise ValueError(f"cannot map code {code!r} to MPI datatype")
    return found
