"""MPI features vpool does not provide, present so programs and mpi4py's test suite can probe
for them: every entry point raises ``NotImplementedError``, which mpi4py's suite turns into a
skip (as it does for an MPI library built without the feature).

- one-sided communication (``Win``): no remote memory access between volunteer machines;
- parallel I/O (``File``): ranks share no file system;
- ports and name publishing (``Open_port``, ``Accept``, ``Connect``, ``Publish_name``...): jobs
  never connect to each other (``Spawn`` is in ``spawn``: it asks the pool for more ranks of the
  same job);
- sessions (``Session``): the world model (Init/COMM_WORLD) only, for now.
"""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = [
    "DISPLACEMENT_CURRENT",
    "DISP_CUR",
    "FILE_NULL",
    "LOCK_EXCLUSIVE",
    "LOCK_SHARED",
    "MODE_APPEND",
    "MODE_CREATE",
    "MODE_DELETE_ON_CLOSE",
    "MODE_EXCL",
    "MODE_NOCHECK",
    "MODE_NOPRECEDE",
    "MODE_NOPUT",
    "MODE_NOSTORE",
    "MODE_NOSUCCEED",
    "MODE_RDONLY",
    "MODE_RDWR",
    "MODE_SEQUENTIAL",
    "MODE_UNIQUE_OPEN",
    "MODE_WRONLY",
    "ORDER_C",
    "ORDER_F",
    "ORDER_FORTRAN",
    "SEEK_CUR",
    "SEEK_END",
    "SEEK_SET",
    "SESSION_NULL",
    "WIN_BASE",
    "WIN_CREATE_FLAVOR",
    "WIN_DISP_UNIT",
    "WIN_FLAVOR",
    "WIN_FLAVOR_ALLOCATE",
    "WIN_FLAVOR_CREATE",
    "WIN_FLAVOR_DYNAMIC",
    "WIN_FLAVOR_SHARED",
    "WIN_MODEL",
    "WIN_NULL",
    "WIN_SEPARATE",
    "WIN_SIZE",
    "WIN_UNIFIED",
    "Close_port",
    "File",
    "Lookup_name",
    "Open_port",
    "Publish_name",
    "Register_datarep",
    "Session",
    "Unpublish_name",
    "Win",
]

# MPI-IO access modes and seek/ordering constants, MPICH's values.
MODE_RDONLY = 2
MODE_RDWR = 8
MODE_WRONLY = 4
MODE_CREATE = 1
MODE_EXCL = 64
MODE_DELETE_ON_CLOSE = 16
MODE_UNIQUE_OPEN = 32
MODE_SEQUENTIAL = 256
MODE_APPEND = 128
SEEK_SET = 600
SEEK_CUR = 602
SEEK_END = 604
DISPLACEMENT_CURRENT = -54278278
ORDER_C = 56
ORDER_FORTRAN = 57
DISP_CUR = DISPLACEMENT_CURRENT
ORDER_F = ORDER_FORTRAN

# RMA assertion and lock constants.
MODE_NOCHECK = 1024
MODE_NOSTORE = 2048
MODE_NOPUT = 4096
MODE_NOPRECEDE = 8192
MODE_NOSUCCEED = 16384
LOCK_EXCLUSIVE = 234
LOCK_SHARED = 235
WIN_BASE = 0x66000001
WIN_SIZE = 0x66000003
WIN_DISP_UNIT = 0x66000005
WIN_CREATE_FLAVOR = 0x66000007
WIN_FLAVOR = WIN_CREATE_FLAVOR
WIN_MODEL = 0x66000009
WIN_FLAVOR_CREATE = 1
WIN_FLAVOR_ALLOCATE = 2
WIN_FLAVOR_DYNAMIC = 3
WIN_FLAVOR_SHARED = 4
WIN_SEPARATE = 1
WIN_UNIFIED = 2


def unsupported(what: str) -> NoReturn:
    raise NotImplementedError(f"{what} is not supported by vpool's MPI runtime")


class _Unsupported:
    """A null handle of an unsupported kind; creating a real one raises NotImplementedError."""

    _what = ""

    def __init__(self, other: Any = None) -> None:
        pass

    def __bool__(self) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    def Free(self) -> None:
        pass


class Win(_Unsupported):
    """``MPI.Win``: one-sided communication (RMA)."""

    @classmethod
    def Create(cls, *args: Any, **kwargs: Any) -> Win:
        unsupported("one-sided communication (MPI.Win)")

    Allocate = Create
    Allocate_shared = Create
    Create_dynamic = Create

    @classmethod
    def Create_errhandler(cls, *args: Any) -> Any:
        unsupported("one-sided communication (MPI.Win)")

    @classmethod
    def Create_keyval(cls, *args: Any, **kwargs: Any) -> int:
        unsupported("one-sided communication (MPI.Win)")


class File(_Unsupported):
    """``MPI.File``: parallel I/O (MPI-IO)."""

    @classmethod
    def Open(cls, *args: Any, **kwargs: Any) -> File:
        unsupported("parallel I/O (MPI.File)")

    @classmethod
    def Delete(cls, *args: Any, **kwargs: Any) -> None:
        unsupported("parallel I/O (MPI.File)")

    @classmethod
    def Create_errhandler(cls, *args: Any) -> Any:
        unsupported("parallel I/O (MPI.File)")

    def Close(self) -> None:
        pass


class Session(_Unsupported):
    """``MPI.Session``: the MPI 4 sessions model."""

    @classmethod
    def Init(cls, *args: Any, **kwargs: Any) -> Session:
        unsupported("MPI sessions (MPI.Session)")

    @classmethod
    def Create_errhandler(cls, *args: Any) -> Any:
        unsupported("MPI sessions (MPI.Session)")

    def Finalize(self) -> None:
        pass


def Open_port(info: Any = None) -> str:
    unsupported("dynamic processes (ports)")


def Close_port(port_name: str) -> None:
    unsupported("dynamic processes (ports)")


def Publish_name(*args: Any) -> None:
    unsupported("dynamic processes (name publishing)")


def Unpublish_name(*args: Any) -> None:
    unsupported("dynamic processes (name publishing)")


def Lookup_name(*args: Any) -> str:
    unsupported("dynamic processes (name publishing)")


def Register_datarep(*args: Any) -> None:
    unsupported("parallel I/O (data representations)")


WIN_NULL = Win()
FILE_NULL = File()
SESSION_NULL = Session()
