"""Errors of the coordinator; each one becomes one ``ErrorBody`` response.

    CoordinatorError            500 internal (never raised on purpose)
     +-- BadRequest             422 bad_request, not_python, bad_bundle, ... (the client's input)
     +-- HashMismatch           400 hash_mismatch
     +-- Unauthorized           401 missing/unknown credentials
     +-- Forbidden              403 valid credentials, not allowed
     +-- NotFound               404 unknown job, blob, relay (or someone else's job)
     +-- Conflict               409 the thing is in the wrong state
     +-- TooLarge               413 body over a configured limit

``code`` is machine readable; ``message`` is for humans and never holds a traceback.
"""

from __future__ import annotations


class CoordinatorError(Exception):
    status = 500
    code = "internal"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class BadRequest(CoordinatorError):
    status = 422
    code = "bad_request"


class HashMismatch(CoordinatorError):
    status = 400
    code = "hash_mismatch"


class Unauthorized(CoordinatorError):
    status = 401
    code = "unauthorized"


class Forbidden(CoordinatorError):
    status = 403
    code = "forbidden"


class NotFound(CoordinatorError):
    status = 404
    code = "not_found"


class Conflict(CoordinatorError):
    status = 409
    code = "conflict"


class TooLarge(CoordinatorError):
    status = 413
    code = "too_large"


class Stalled(CoordinatorError):
    status = 408
    code = "upload_stalled"
