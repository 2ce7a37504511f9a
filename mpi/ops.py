"""Reduction operations: ``MPI.Op`` objects for Python objects and for typed buffers.

Operand order is MPI's: ``op(a, b)`` with ``a`` from lower ranks, so non-commutative and
floating-point reductions give the same result on every run. On Python objects an op is a
function of two arguments (mpi4py's semantics: ``SUM(a, b) == a + b``, ``MAXLOC`` on
``(value, index)`` pairs). On buffers it is applied with numpy to views of the bytes; user ops
made by ``Op.Create(function)`` get ``function(invec, inoutvec, datatype)`` as in MPI and must
leave the result in ``inoutvec``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vpool.mpi import errors
from vpool.mpi.datatypes import Datatype


def _maxloc(x: Any, y: Any) -> Any:
    u, i = x
    v, j = y
    if u > v:
        return u, i
    if v > u:
        return v, j
    return (v, j) if j < i else (u, i)


def _minloc(x: Any, y: Any) -> Any:
    u, i = x
    v, j = y
    if u < v:
        return u, i
    if v < u:
        return v, j
    return (v, j) if j < i else (u, i)


def _lxor(x: Any, y: Any) -> Any:
    return bool(x) != bool(y)


_PY: dict[str, Callable[[Any, Any], Any]] = {
    "MAX": lambda x, y: y if y > x else x,
    "MIN": lambda x, y: y if y < x else x,
    "SUM": lambda x, y: x + y,
    "PROD": lambda x, y: x * y,
    "LAND": lambda x, y: bool(x) and bool(y),
    "BAND": lambda x, y: x & y,
    "LOR": lambda x, y: bool(x) or bool(y),
    "BOR": lambda x, y: x | y,
    "LXOR": _lxor,
    "BXOR": lambda x, y: x ^ y,
    "MAXLOC": _maxloc,
    "MINLOC": _minloc,
    "REPLACE": lambda x, y: y,
    "NO_OP": lambda x, y: x,
}


MAX_USER_OPS = 32
"""Live user-defined operations allowed at once (MPICH's limit, which mpi4py's tests expect)."""

_user_slots: dict[int, Callable[..., Any]] = {}


class Op:
    """``MPI.Op``: a predefined operation (``_name`` is its constant's name, ``OP_NULL``
    included) or one made by ``Op.Create`` (``_user`` is the function, ``_slot`` its entry in
    the registry of live user operations)."""

    __slots__ = ("_commute", "_name", "_slot", "_user")

    def __init__(self, op: Op | None = None) -> None:
        if op is not None:
            self._name, self._user, self._commute = op._name, op._user, op._commute
            self._slot = op._slot
        else:
            self._name, self._user, self._commute, self._slot = "OP_NULL", None, True, 0

    @classmethod
    def _predefined(cls, name: str) -> Op:
        op = cls.__new__(cls)
        op._name, op._user, op._commute, op._slot = name, None, True, 0
        return op

    @classmethod
    def Create(cls, function: Callable[..., Any], commute: bool = False) -> Op:
        if len(_user_slots) >= MAX_USER_OPS:
            raise RuntimeError(f"too many user-defined reduction operations ({MAX_USER_OPS})")
        slot = 1
        while slot in _user_slots:
            slot += 1
        _user_slots[slot] = function
        op = cls.__new__(cls)
        op._name, op._user, op._commute, op._slot = "", function, bool(commute), slot
        return op

    def Free(self) -> None:
        if self._user is None:
            raise errors.MPIException(errors.ERR_OP, "cannot free a null or predefined operation")
        if self._user is not None:
            _user_slots.pop(self._slot, None)
        self._name, self._user, self._commute, self._slot = "OP_NULL", None, True, 0

    def Is_commutative(self) -> bool:
        return self._commute

    @property
    def is_commutative(self) -> bool:
        return self._commute

    @property
    def is_predefined(self) -> bool:
        return self._user is None

    def toint(self) -> int:
        return -1

    def __bool__(self) -> bool:
        return self._user is not None or self._name != "OP_NULL"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Op):
            return NotImplemented
        return self._name == other._name and self._slot == other._slot

    def __hash__(self) -> int:
        return hash((self._name, self._slot))

    def __repr__(self) -> str:
        return f"<mpi4py.MPI.Op {self._name or 'user'}>"

    def __reduce__(self) -> Any:
        if self._user is None:
            if globals().get(self._name) is self:
                return self._name  # the module's constant itself
            return (Op, (globals()[self._name],))
        return (type(self).Create, (self._user, self._commute))

    def __call__(self, x: Any, y: Any) -> Any:
        """Combine two Python objects, ``x`` from the lower ranks."""
        if self._user is not None:
            return self._user(x, y, None)
        if self._name == "OP_NULL":
            raise ValueError("cannot call user-defined operation")
        return _PY[self._name](x, y)

    # ---- buffers -------------------------------------------------------------------------

    def reduce_bytes(self, a: memoryview, b: memoryview, datatype: Datatype) -> None:
        """``b = a op b`` elementwise, in place in ``b``; ``a`` holds the lower ranks' part."""
        if self._user is not None:
            self._user(_typed(a, datatype), _typed(b, datatype), datatype)
            return
        _apply_numpy(self._name, a, b, datatype)

    def Reduce_local(self, inbuf: Any, inoutbuf: Any) -> None:
        from vpool.mpi.buffers import parse

        src = parse(inbuf, writable=False)
        dst = parse(inoutbuf, writable=True)
        if src.datatype != dst.datatype and src.datatype.size != dst.datatype.size:
            raise ValueError("mismatch in inbuf and inoutbuf MPI datatypes")
        if src.view.nbytes != dst.view.nbytes:
            raise ValueError(f"mismatch in inbuf count {src.items} and inoutbuf count {dst.items}")
        self.reduce_bytes(src.view, dst.view, dst.datatype)


def _typed(view: memoryview, datatype: Datatype) -> memoryview:
    """The view as the elements of a basic datatype when it has a struct code, so a user
    function may assign an ``array`` of that type to it (as to mpi4py's buffers)."""
    code = getattr(datatype, "_code", None)
    if code and datatype.extent == datatype.size and len(code) == 1:
        try:
            return view.cast(code)
        except (TypeError, ValueError):
            pass
    return view


def _apply_numpy(name: str, a: memoryview, b: memoryview, datatype: Datatype) -> None:
    import numpy as np

    dtype = datatype.numpy_dtype()
    x = np.frombuffer(a, dtype=dtype)
    y = np.frombuffer(b, dtype=dtype)
    if name in ("MAXLOC", "MINLOC"):
        if dtype.names is None:
            raise errors.MPIException(errors.ERR_OP, f"{name} needs a pair datatype")
        xv, yv = x["v"], y["v"]
        better = (xv > yv) if name == "MAXLOC" else (xv < yv)
        tie_lower = (xv == yv) & (x["i"] < y["i"])
        take = better | tie_lower
        y[take] = x[take]
        return
    if dtype.names is not None:
        raise errors.MPIException(errors.ERR_OP, f"{name} does not apply to pair datatypes")
    if name == "REPLACE":
        return
    if name == "NO_OP":
        y[...] = x
        return
    func = _NUMPY.get(name)
    if func is None:
        raise errors.MPIException(errors.ERR_OP)
    try:
        if name in ("LAND", "LOR", "LXOR"):
            y[...] = getattr(np, func)(x, y)
        else:
            getattr(np, func)(x, y, out=y)
    except TypeError as exc:
        raise errors.MPIException(errors.ERR_OP, str(exc)) from exc


_NUMPY = {
    "SUM": "add",
    "PROD": "multiply",
    "MAX": "maximum",
    "MIN": "minimum",
    "LAND": "logical_and",
    "LOR": "logical_or",
    "LXOR": "logical_xor",
    "BAND": "bitwise_and",
    "BOR": "bitwise_or",
    "BXOR": "bitwise_xor",
}

OP_NULL = Op._predefined("OP_NULL")
MAX = Op._predefined("MAX")
MIN = Op._predefined("MIN")
SUM = Op._predefined("SUM")
PROD = Op._predefined("PROD")
LAND = Op._predefined("LAND")
BAND = Op._predefined("BAND")
LOR = Op._predefined("LOR")
BOR = Op._predefined("BOR")
LXOR = Op._predefined("LXOR")
BXOR = Op._predefined("BXOR")
MAXLOC = Op._predefined("MAXLOC")
MINLOC = Op._predefined("MINLOC")
REPLACE = Op._predefined("REPLACE")
NO_OP = Op._predefined("NO_OP")
