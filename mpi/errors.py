"""MPI error classes and the ``MPI.Exception`` type programs catch.

    RuntimeError
     +-- MPIException   exported as ``MPI.Exception``; ``error_code`` is an MPI error class

Error class values are MPICH's. Every failure of an MPI call made by the program is raised as
``MPIException`` with the matching class (mpi4py's default ``ERRORS_RETURN`` behaviour); failures
of the transport under the runtime end the process instead (see ``transport``).
"""

from __future__ import annotations

from typing import Final

SUCCESS: Final = 0
ERR_BUFFER: Final = 1
ERR_COUNT: Final = 2
ERR_TYPE: Final = 3
ERR_TAG: Final = 4
ERR_COMM: Final = 5
ERR_RANK: Final = 6
ERR_ROOT: Final = 7
ERR_GROUP: Final = 8
ERR_OP: Final = 9
ERR_TOPOLOGY: Final = 10
ERR_DIMS: Final = 11
ERR_ARG: Final = 12
ERR_UNKNOWN: Final = 13
ERR_TRUNCATE: Final = 14
ERR_OTHER: Final = 15
ERR_INTERN: Final = 16
ERR_IN_STATUS: Final = 17
ERR_PENDING: Final = 18
ERR_REQUEST: Final = 19
ERR_ACCESS: Final = 20
ERR_AMODE: Final = 21
ERR_BAD_FILE: Final = 22
ERR_CONVERSION: Final = 23
ERR_DUP_DATAREP: Final = 24
ERR_FILE_EXISTS: Final = 25
ERR_FILE_IN_USE: Final = 26
ERR_FILE: Final = 27
ERR_INFO: Final = 28
ERR_INFO_KEY: Final = 29
ERR_INFO_VALUE: Final = 30
ERR_INFO_NOKEY: Final = 31
ERR_IO: Final = 32
ERR_NAME: Final = 33
ERR_NO_MEM: Final = 34
ERR_NOT_SAME: Final = 35
ERR_NO_SPACE: Final = 36
ERR_NO_SUCH_FILE: Final = 37
ERR_PORT: Final = 38
ERR_QUOTA: Final = 39
ERR_READ_ONLY: Final = 40
ERR_SERVICE: Final = 41
ERR_SPAWN: Final = 42
ERR_UNSUPPORTED_DATAREP: Final = 43
ERR_UNSUPPORTED_OPERATION: Final = 44
ERR_WIN: Final = 45
ERR_BASE: Final = 46
ERR_LOCKTYPE: Final = 47
ERR_KEYVAL: Final = 48
ERR_RMA_CONFLICT: Final = 49
ERR_RMA_SYNC: Final = 50
ERR_SIZE: Final = 51
ERR_DISP: Final = 52
ERR_ASSERT: Final = 53
ERR_RMA_RANGE: Final = 55
ERR_RMA_ATTACH: Final = 56
ERR_RMA_SHARED: Final = 57
ERR_RMA_FLAVOR: Final = 58
ERR_SESSION: Final = 75
ERR_PROC_ABORTED: Final = 76
ERR_VALUE_TOO_LARGE: Final = 77
ERR_LASTCODE: Final = 0x3FFFFFFF
# Classes MPICH 4.0 lacks: mpi4py maps them to MPI_ERR_LASTCODE.
ERR_ERRHANDLER: Final = ERR_LASTCODE
ERR_ABI: Final = ERR_LASTCODE
# Fault-tolerance classes (ULFM, ``vpool.mpi.ulfm``): MPICH's MPIX_ERR_* values.
ERR_PROC_FAILED: Final = 101
ERR_PROC_FAILED_PENDING: Final = 102
ERR_REVOKED: Final = 103
_LAST_MPIX: Final = 105  # MPICH_ERR_LAST_MPIX: classes added by programs come after it

_STRINGS: Final = {
    SUCCESS: "No MPI error",
    ERR_BUFFER: "Invalid buffer pointer",
    ERR_COUNT: "Invalid count",
    ERR_TYPE: "Invalid datatype",
    ERR_TAG: "Invalid tag",
    ERR_COMM: "Invalid communicator",
    ERR_RANK: "Invalid rank",
    ERR_ROOT: "Invalid root",
    ERR_GROUP: "Invalid group",
    ERR_OP: "Invalid MPI_Op",
    ERR_TOPOLOGY: "Invalid topology",
    ERR_DIMS: "Invalid dimension argument",
    ERR_ARG: "Invalid argument",
    ERR_UNKNOWN: "Unknown error",
    ERR_TRUNCATE: "Message truncated",
    ERR_OTHER: "Other MPI error",
    ERR_INTERN: "Internal MPI error!",
    ERR_IN_STATUS: "See the MPI_ERROR field in MPI_Status for the error code",
    ERR_PENDING: "Pending request (no error)",
    ERR_REQUEST: "Invalid MPI_Request",
    ERR_KEYVAL: "Invalid keyval",
    ERR_NO_MEM: "Out of memory",
    ERR_UNSUPPORTED_OPERATION: "Unsupported operation",
    ERR_SIZE: "Invalid size",
    ERR_VALUE_TOO_LARGE: "Value is too large to store",
    ERR_PROC_FAILED: "Process failed",
    ERR_PROC_FAILED_PENDING: "Request pending due to failure",
    ERR_REVOKED: "Communication object revoked",
}

_user_classes: list[int] = []
_user_strings: dict[int, str] = {}


def error_string(code: int) -> str:
    if code in _user_strings:
        return _user_strings[code]
    return _STRINGS.get(code, f"Unknown error class {code}" if code != SUCCESS else _STRINGS[0])


def add_error_class() -> int:
    code = max([_LAST_MPIX, *_user_classes]) + 1
    _user_classes.append(code)
    return code


def add_error_string(code: int, string: str) -> None:
    _user_strings[code] = string


def error_class(code: int) -> int:
    """Error codes and classes coincide here: the runtime raises classes only."""
    return code


class MPIException(RuntimeError):
    """``MPI.Exception``: an MPI call failed with error class ``error_code``."""

    def __init__(self, ierr: int = SUCCESS, detail: str | None = None) -> None:
        self.ob_mpi = int(ierr)
        self.detail = detail
        super().__init__(int(ierr))

    @property
    def error_code(self) -> int:
        return self.ob_mpi

    @property
    def error_class(self) -> int:
        return error_class(self.ob_mpi)

    @property
    def error_string(self) -> str:
        return error_string(self.ob_mpi)

    def Get_error_code(self) -> int:
        return self.ob_mpi

    def Get_error_class(self) -> int:
        return error_class(self.ob_mpi)

    def Get_error_string(self) -> str:
        return error_string(self.ob_mpi)

    def __int__(self) -> int:
        return self.ob_mpi

    def __hash__(self) -> int:
        return hash(self.ob_mpi)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, MPIException):
            return self.ob_mpi == other.ob_mpi
        if isinstance(other, int):
            return self.ob_mpi == other
        return NotImplemented

    def __bool__(self) -> bool:
        return self.ob_mpi != SUCCESS

    def __repr__(self) -> str:
        return f"MPI.Exception({self.ob_mpi})"

    def __str__(self) -> str:
        text = error_string(self.ob_mpi)
        return f"{text}: {self.detail}" if self.detail else text
