"""Why something failed, in words: the most useful text of an exception and its causes.

Transport libraries wrap the reason deep inside (httpx's ``ConnectError('')`` around an
``ssl.SSLCertVerificationError``, say), so a log line built from the outer exception says
nothing ("failed: ;"). ``describe`` walks the causes: a certificate failure is named as such,
else the innermost non-empty message wins, else the exception's type.
"""

from __future__ import annotations

import ssl

TRUST = "TLS certificate not trusted"


def describe(exc: BaseException) -> str:
    text, seen = "", set[int]()
    cause: BaseException | None = exc
    timed_out = False
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        message = str(cause).strip()
        if isinstance(cause, ssl.SSLCertVerificationError):
            return f"{TRUST}: {cause.verify_message or message}"
        if "CERTIFICATE_VERIFY_FAILED" in message:
            return f"{TRUST}: {message}"
        if isinstance(cause, TimeoutError) or "Timeout" in type(cause).__name__:
            timed_out = True
        if message:
            text = message
        cause = cause.__cause__ or cause.__context__
    if text:
        return text
    return "timed out" if timed_out else type(exc).__name__


def untrusted(exc: BaseException) -> bool:
    """Whether ``exc`` (or a cause) is a failure to trust the server's certificate: no retry
    will help until the CA setting changes."""
    return describe(exc).startswith(TRUST)
