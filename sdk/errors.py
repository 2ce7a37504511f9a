"""Errors of the scientist's SDK.

    VsdkError                   base of everything ``vpool.sdk`` raises (exit code 1)
     +-- ConfigError            the client config is missing or malformed
     +-- BundleError            a program or input file cannot be bundled
     +-- LocalPoolError         ``vsdk local`` cannot start, stop or find the local pool
     +-- WaitTimeout            ``Client.wait`` gave up; ``job`` is the job as it was then
     +-- ConnectionError        the coordinator cannot be reached (refused, TLS, timeout; exit 5)
     +-- ApiError               the coordinator answered with an error ``{code, message}``
          +-- AuthError         401/403: the token is missing, wrong or not allowed (exit 5)
          +-- NotFoundError     404: no such job (or not one of yours)

Lower-layer errors (httpx, zipfile, OS) are translated in one place each (``Client._request``,
``bundle``) with ``raise X(...) from exc``. ``exit_code`` is what ``vsdk`` exits with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vpool.protocol.api import JobInfo


class VsdkError(Exception):
    """Base class of every error raised by ``vpool.sdk``."""

    exit_code = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(VsdkError):
    """No usable client configuration (run ``vsdk login`` or ``vsdk local up``)."""


class BundleError(VsdkError):
    """A program or input file is missing or cannot be packed into a bundle."""


class LocalPoolError(VsdkError):
    """The local pool cannot be started, stopped or inspected."""


class WaitTimeout(VsdkError):
    """A job did not end within the time given; ``job`` is how it was when we gave up."""

    def __init__(self, message: str, job: JobInfo) -> None:
        super().__init__(message)
        self.job = job


class ConnectionError(VsdkError):
    """The coordinator cannot be reached: refused, unknown host, TLS failure, timeout."""

    exit_code = 5


class ApiError(VsdkError):
    """The coordinator answered with an error body ``{"error": {"code", "message"}}``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{message} ({code}, HTTP {status})")
        self.status = status
        self.code = code
        self.message = message


class AuthError(ApiError):
    """The API token is missing, wrong or does not allow this."""

    exit_code = 5


class NotFoundError(ApiError):
    """The job (or blob) does not exist or is not yours."""


def api_error(status: int, code: str, message: str) -> ApiError:
    """The most specific ``ApiError`` subclass for an HTTP status."""
    if status in (401, 403):
        return AuthError(status, code, message)
    if status == 404:
        return NotFoundError(status, code, message)
    return ApiError(status, code, message)
