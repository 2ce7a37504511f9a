"""How a derived datatype was built: ``combiner``, ``Get_envelope``, ``Get_contents`` and
``decode`` as mpi4py has them, plus ``Create_subarray`` and the ``_typealign``/``_typecode``
helpers ``mpi4py.util.dtlib`` uses.

Each constructor records ``(combiner name, old datatypes, parameters)`` on the new datatype.
The old datatypes are kept as copies of their handles, so freeing them after construction (as
MPI allows) leaves what ``decode`` returns intact.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

from vpool.mpi import constants, derived, errors

if TYPE_CHECKING:
    from vpool.mpi.datatypes import Datatype

Env = tuple[str, tuple[Any, ...], dict[str, Any]]

ORDER_C = 56
ORDER_FORTRAN = 57


def record(dt: Datatype, combiner: str, olds: Any, **params: Any) -> Datatype:
    from vpool.mpi.datatypes import Datatype

    olds = olds if isinstance(olds, (list, tuple)) else [olds]
    keep = tuple(o if o.is_predefined else Datatype(o) for o in olds)
    dt._env = (combiner, keep, params)
    return dt


def _env(dt: Datatype) -> Env | None:
    if not dt:
        raise errors.MPIException(errors.ERR_TYPE, "null datatype")
    return dt._env


def combiner(dt: Datatype) -> int:
    env = _env(dt)
    name = "NAMED" if env is None else env[0]
    return int(getattr(constants, f"COMBINER_{name}"))


def _copies(olds: tuple[Any, ...]) -> list[Any]:
    from vpool.mpi.datatypes import Datatype

    return [o if o.is_predefined else Datatype(o) for o in olds]


def decode(dt: Datatype) -> tuple[Any, str, dict[str, Any]]:
    env = _env(dt)
    if env is None:
        return dt, "NAMED", {}
    name, olds, params = env
    types = _copies(olds)
    info = {k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in params.items()}
    if name == "STRUCT":
        info["datatypes"] = types
    return types[0], name, info


def contents(dt: Datatype) -> tuple[list[int], list[int], list[int], list[Any]]:
    """(integers, addresses, large counts, datatypes) as ``Get_contents`` gives them."""
    env = _env(dt)
    if env is None:
        raise errors.MPIException(errors.ERR_ARG, "Get_contents of a named datatype")
    name, olds, p = env
    ints: list[int] = []
    addrs: list[int] = []
    if name == "CONTIGUOUS":
        ints = [p["count"]]
    elif name == "VECTOR":
        ints = [p["count"], p["blocklength"], p["stride"]]
    elif name == "HVECTOR":
        ints, addrs = [p["count"], p["blocklength"]], [p["stride"]]
    elif name == "INDEXED":
        ints = [len(p["blocklengths"]), *p["blocklengths"], *p["displacements"]]
    elif name == "HINDEXED":
        ints, addrs = [len(p["blocklengths"]), *p["blocklengths"]], list(p["displacements"])
    elif name == "INDEXED_BLOCK":
        ints = [len(p["displacements"]), p["blocklength"], *p["displacements"]]
    elif name == "HINDEXED_BLOCK":
        ints, addrs = [len(p["displacements"]), p["blocklength"]], list(p["displacements"])
    elif name == "STRUCT":
        ints, addrs = [len(p["blocklengths"]), *p["blocklengths"]], list(p["displacements"])
    elif name == "RESIZED":
        addrs = [p["lb"], p["extent"]]
    elif name == "SUBARRAY":
        ints = [len(p["sizes"]), *p["sizes"], *p["subsizes"], *p["starts"], p["order"]]
    return ints, addrs, [], _copies(olds)


def envelope(dt: Datatype) -> tuple[int, int, int, int, int]:
    """(integers, addresses, large counts, datatypes, combiner), as ``Get_envelope``."""
    if _env(dt) is None:
        return (0, 0, 0, 0, int(constants.COMBINER_NAMED))
    ints, addrs, large, types = contents(dt)
    return (len(ints), len(addrs), len(large), len(types), combiner(dt))


def subarray(old: Datatype, sizes: Any, subsizes: Any, starts: Any, order: int) -> Datatype:
    sizes, subsizes = list(map(int, sizes)), list(map(int, subsizes))
    starts = list(map(int, starts))
    ndims = len(sizes)
    if not (ndims == len(subsizes) == len(starts)) or ndims == 0:
        raise errors.MPIException(errors.ERR_ARG, "subarray: mismatched dimensions")
    for n, s, st in zip(sizes, subsizes, starts, strict=True):
        if n <= 0 or s <= 0 or s > n or st < 0 or st + s > n:
            raise errors.MPIException(errors.ERR_ARG, "subarray: invalid sizes or starts")
    if order not in (ORDER_C, ORDER_FORTRAN):
        raise errors.MPIException(errors.ERR_ARG, f"subarray: invalid order {order}")
    ext = old._extent
    # Work in C order: reverse the dimensions of a Fortran-ordered array.
    dims = list(zip(sizes, subsizes, starts, strict=True))
    if order == ORDER_FORTRAN:
        dims.reverse()
    strides = [1] * ndims
    for i in range(ndims - 2, -1, -1):
        strides[i] = strides[i + 1] * dims[i + 1][0]
    rows: list[int] = [0]
    for i in range(ndims - 1):
        _, sub, st = dims[i]
        rows = [r + (st + k) * strides[i] for r in rows for k in range(sub)]
    _, last_sub, last_st = dims[-1]
    blocks = [((r + last_st) * ext, last_sub, old) for r in rows]
    total = 1
    for n in sizes:
        total *= n
    return derived.resized(derived.build(blocks), 0, total * ext)


def pad_struct(dt: Datatype, types: list[Any]) -> None:
    """Round a struct's extent up to its alignment, as C (and MPICH) lays out structs."""
    aligns = [a for a in map(_align, types) if a]
    if aligns and dt._extent > 0:
        align = max(aligns)
        dt._extent = -(-dt._extent // align) * align


def typealign(dt: Datatype) -> int | None:
    """``MPI._typealign``: the alignment of a predefined datatype, None for derived ones."""
    return _align(dt) if dt and dt.is_predefined else None


def _align(dt: Datatype) -> int | None:
    import numpy as np

    if not dt:
        return None
    env = dt._env
    if env is None:
        from vpool.mpi.datatypes import _PAIR_NAMES, _PAIRS

        if dt._name in _PAIR_NAMES:
            return max(np.dtype(c).alignment for c in _PAIRS[_PAIR_NAMES[dt._name]])
        if dt._code is None:
            return None
        return int(np.dtype(dt._code).alignment)
    aligns = [_align(o) for o in env[1]]
    known = [a for a in aligns if a is not None]
    return max(known) if known else None


def typecode(dt: Datatype) -> str | None:
    from vpool.mpi import typecodes

    try:
        return typecodes.tocode(dt)
    except ValueError:
        return None


def as_rank(value: Any) -> int:
    """A rank (or root, source, destination) as mpi4py takes it: an int, anything with
    ``__index__`` (numpy integers), or a float that is whole (``rank - size / 2``); another
    float is a TypeError, as passing it to C would be."""
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise TypeError(f"a rank must be an integer, not {value!r}")
    return operator.index(value)
