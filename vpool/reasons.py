"""Why something failed, in words: an exception's type and the most useful text of it and its
causes, for log lines and error messages.

Transport libraries wrap the reason deep inside and often with no text of their own: under trio
httpx raises ``ConnectError('')`` around a ``BrokenResourceError('')`` around the
``ssl.SSLCertVerificationError``, and ``ReadTimeout('')`` around a ``trio.TooSlowError()``. A log
line built from ``str(exc)`` then says nothing ("failed: ;"). ``describe`` always names the type,
takes the text from the first cause that has one when the exception itself has none, names a
certificate failure as such, says which timeout ran out when the request tells, and summarizes
exception groups.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator

TRUST = "TLS certificate not trusted"
MAX_CHARS = 500
_MAX_LEAVES = 3  # of an exception group, described one by one; the rest are counted
_MAX_DEPTH = 3  # of nested exception groups
# What each httpx timeout measures (the request's "timeout" extension has one value of each).
_TIMEOUTS = {
    "ConnectTimeout": ("connect", "no connection within"),
    "ReadTimeout": ("read", "no answer within"),
    "WriteTimeout": ("write", "could not send within"),
    "PoolTimeout": ("pool", "no free connection within"),
}


def describe(exc: BaseException, *, limit: int = MAX_CHARS) -> str:
    """``"TypeName: text"``, or ``"TypeName"`` when nothing says more; never empty, at most
    ``limit`` characters."""
    text = _describe(exc, 0)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def untrusted(exc: BaseException) -> bool:
    """Whether ``exc`` (or a cause) is a failure to trust the server's certificate: no retry
    will help until the CA setting changes."""
    return any(
        isinstance(cause, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(cause)
        for cause in _chain(exc)
    )


def _describe(exc: BaseException, depth: int) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return _group(exc, depth)
    name = type(exc).__name__
    text = _text(exc)
    for cause in _chain(exc):
        if isinstance(cause, ssl.SSLCertVerificationError):
            text = f"{TRUST}: {_text(cause) or cause.verify_message}"
            break
        if isinstance(cause, BaseExceptionGroup):
            # trio's open_tcp_stream: "all attempts to connect to h:p failed" around the
            # refusals, one per address tried.
            inner = _group_leaves(cause, depth + 1)
            text = f"{text} ({inner})" if text else inner
            break
        if type(cause).__name__ == "Cancelled":
            break  # how trio ended a wait ("cancelled due to deadline"), not why
        if not text:
            text = _text(cause)
    if "CERTIFICATE_VERIFY_FAILED" in text and TRUST not in text:
        text = f"{TRUST}: {text}"
    said = f"{name}: {text}" if text else name
    waited = _timeout(exc)
    return f"{said} ({waited})" if waited else said


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``'s causes, outermost first, ``exc`` itself not included."""
    seen = {id(exc)}
    # The context even when suppressed: httpcore raises ``ConnectError(exc) from None``, the
    # reason left only as the context (and as an argument, whose str() may be empty).
    cause = exc.__cause__ or exc.__context__
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        yield cause
        cause = cause.__cause__ or cause.__context__


def _text(exc: BaseException) -> str:
    """``exc``'s own text, or "" when it says nothing (empty, or just its type's name)."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.message.strip()
    try:
        text = str(exc).strip()
    except Exception:  # a broken __str__ must not break the log line that reports it
        return ""
    return "" if text == type(exc).__name__ else text


def _group(group: BaseExceptionGroup[BaseException], depth: int) -> str:
    head = type(group).__name__
    if group.message.strip():
        head = f"{head}: {group.message.strip()}"
    return f"{head} ({_group_leaves(group, depth + 1)})"


def _group_leaves(group: BaseExceptionGroup[BaseException], depth: int) -> str:
    """What the group holds: each distinct description once (with a count when repeated), the
    first few of them, and how many more there are."""
    if depth > _MAX_DEPTH:
        return f"{len(group.exceptions)} sub-exceptions"
    counts: dict[str, int] = {}
    for sub in group.exceptions:
        text = _describe(sub, depth)
        counts[text] = counts.get(text, 0) + 1
    said = [f"{text} ({n} times)" if n > 1 else text for text, n in counts.items()]
    more = len(said) - _MAX_LEAVES
    return "; ".join(said[:_MAX_LEAVES]) + (f"; and {more} more" if more > 0 else "")


def _timeout(exc: BaseException) -> str:
    """Which time ran out, when an httpx timeout's request says it ("no answer within 10 s")."""
    kind = _TIMEOUTS.get(type(exc).__name__)
    if kind is None:
        return ""
    try:
        timeouts = exc.request.extensions.get("timeout", {})  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):  # httpx raises RuntimeError when no request is set
        return ""
    seconds = timeouts.get(kind[0]) if isinstance(timeouts, dict) else None
    if not isinstance(seconds, int | float):
        return ""
    return f"{kind[1]} {seconds:g} s"
