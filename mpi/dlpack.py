"""Buffers exported through DLPack (``__dlpack__``) or ``__cuda_array_interface__``, as mpi4py
accepts them: a flat writable byte view of the exporter's host memory, no copy.

Only host (CPU) memory can travel: vpool ranks have no device memory to read from. A DLPack
capsule is read with ctypes (numpy's ``from_dlpack`` would do, but marks legacy capsules
read-only, and receives must write into them).
"""

from __future__ import annotations

import ctypes
from typing import Any

_CPU = 1
_CPU_PINNED = 3


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int32)]


class _DType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _Version(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class _Versioned(ctypes.Structure):
    _fields_ = [
        ("version", _Version),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _Tensor),
    ]


_READ_ONLY = 1

_api = ctypes.pythonapi
_IsValid = _api.PyCapsule_IsValid
_IsValid.restype = ctypes.c_int
_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_GetPointer = _api.PyCapsule_GetPointer
_GetPointer.restype = ctypes.c_void_p
_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]


class _Keep:
    """Owner of an exported memory block: the memoryview keeps it (and the exporter) alive."""

    __slots__ = ("capsule", "exporter")

    def __init__(self, exporter: Any, capsule: Any) -> None:
        self.exporter, self.capsule = exporter, capsule


def exported_view(obj: Any) -> memoryview | None:
    """A flat 'B' view of ``obj``'s memory if it exports DLPack or a CUDA array interface."""
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        return _from_dlpack(obj)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if isinstance(cai, dict):
        return _from_cai(obj, cai)
    return None


def _contiguous(shape: list[int], strides: list[int] | None, itemsize: int) -> bool:
    if strides is None:
        return True
    expected = itemsize
    for n, s in zip(reversed(shape), reversed(strides), strict=True):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def _view(obj: Any, capsule: Any, address: int, nbytes: int, readonly: bool) -> memoryview:
    if nbytes == 0:
        return memoryview(bytearray(0))
    mem = (ctypes.c_char * nbytes).from_address(address)
    view = memoryview(mem).cast("B")
    # The view keeps ``mem`` alive, ``mem`` the exporter. No reference cycle: freeing must not
    # wait for the cyclic collector (which may run at any point and release the exporter).
    mem._vpool_keep = _Keep(obj, capsule)  # type: ignore[attr-defined]
    return view.toreadonly() if readonly else view


def _tensor(obj: Any) -> tuple[Any, _Tensor, bool]:
    device, _ = obj.__dlpack_device__()
    if int(device) not in (_CPU, _CPU_PINNED):
        raise BufferError("message: only host (CPU) memory can be sent by vpool ranks")
    try:
        capsule = obj.__dlpack__(max_version=(1, 0))
    except TypeError:
        capsule = obj.__dlpack__()
    readonly = False
    if _IsValid(capsule, b"dltensor_versioned"):
        managed = _Versioned.from_address(_GetPointer(capsule, b"dltensor_versioned"))
        tensor = managed.dl_tensor
        readonly = bool(managed.flags & _READ_ONLY)
    elif _IsValid(capsule, b"dltensor"):
        tensor = _Tensor.from_address(_GetPointer(capsule, b"dltensor"))
    else:
        raise BufferError("message: invalid DLPack capsule")
    return capsule, tensor, readonly


# DLPack type codes -> numpy kind letters (kDLInt, kDLUInt, kDLFloat, kDLComplex, kDLBool).
_KINDS = {0: "i", 1: "u", 2: "f", 5: "c", 6: "b"}
_WIDE = {"f16": "g", "c32": "G"}  # long double (complex) as x86-64 stores it


def exported_typecode(obj: Any) -> str | None:
    """The numpy-style type code of a DLPack / CUDA-array-interface buffer (None: unknown).

    Read from the capsule directly: numpy's ``from_dlpack`` rejects long doubles and would leave
    the exporter's capsule in a failed state."""
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        _, tensor, _ = _tensor(obj)
        kind = _KINDS.get(tensor.dtype.code)
        lanes = tensor.dtype.lanes
        if kind == "f" and lanes == 2:  # how some exporters spell complex numbers
            kind, lanes = "c", 1
        if kind is None or lanes != 1:
            return None
        if kind == "b":
            return "?"
        code = f"{kind}{tensor.dtype.bits * tensor.dtype.lanes // 8}"
        return _WIDE.get(code, code)
    cai = getattr(obj, "__cuda_array_interface__", None)
    if isinstance(cai, dict):
        import numpy as np

        return str(np.dtype(cai["typestr"]).char)
    return None


def _from_dlpack(obj: Any) -> memoryview:
    capsule, tensor, readonly = _tensor(obj)
    ndim = tensor.ndim
    shape = [tensor.shape[i] for i in range(ndim)]
    strides = [tensor.strides[i] for i in range(ndim)] if tensor.strides else None
    itemsize = tensor.dtype.bits * tensor.dtype.lanes // 8
    if not _contiguous(shape, strides, 1):  # DLPack strides count elements
        raise BufferError("message: DLPack tensor is not C-contiguous")
    count = 1
    for n in shape:
        count *= n
    address = (tensor.data or 0) + tensor.byte_offset
    return _view(obj, capsule, address, count * itemsize, readonly)


def _from_cai(obj: Any, cai: dict[str, Any]) -> memoryview:
    import numpy as np

    address, readonly = cai["data"]
    shape = list(cai["shape"])
    itemsize = np.dtype(cai["typestr"]).itemsize
    strides = cai.get("strides")
    if strides is not None and not _contiguous(shape, list(strides), itemsize):
        raise BufferError("message: CUDA array interface buffer is not C-contiguous")
    count = 1
    for n in shape:
        count *= n
    return _view(obj, None, address or 0, count * itemsize, bool(readonly))
