"""Errors of the relay.

    RelayError
     +-- StorageError      the on-disk log cannot be read or written (the relay cannot go on)
     +-- CoordinatorError  the coordinator refused a call or could not be reached

What an agent asks that is refused (it broke the protocol, presented a bad token, asked for what
it may not have) is ``protocol.relay_core.Refused``: the relay sends ``Error(code, message, job,
rank)`` and closes the connection when the code's scope says so. Protocol-level faults raised by
``vpool.protocol`` (``RemoteProtocolError``, ``TokenError``) become ``Refused`` in one place,
``connection.rejection``.
"""

from __future__ import annotations

from vpool.protocol.errors import ErrorCode


class RelayError(Exception):
    """Base class of the relay's errors."""

    code = "relay_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class StorageError(RelayError):
    """The log directory is unusable (disk full, I/O error, permissions)."""

    code = ErrorCode.STORAGE_ERROR


class CoordinatorError(RelayError):
    """A coordinator call failed. ``status`` is the HTTP status, or None when the coordinator
    could not be reached at all."""

    code = "coordinator_error"

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None):
        super().__init__(message, code=code)
        self.status = status
