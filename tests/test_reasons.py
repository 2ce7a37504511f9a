"""``vpool.reasons.describe`` on real failures: what httpx raises on 127.0.0.1 when nobody
listens, when the server's certificate is not trusted and when no answer comes, under trio (as
the agent and the relay call) and in a thread (as vsdk does)."""

from __future__ import annotations

import datetime as dt
import socket
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest
import trio

from vpool import tls
from vpool.protocol import pki
from vpool.reasons import MAX_CHARS, TRUST, describe, untrusted


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port bound but not listening: a connection to it is refused (and, held bound, no other
    test takes it meanwhile)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port whose connections the kernel completes and nobody ever answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


@pytest.fixture
def other_ca(tmp_path: Path) -> Path:
    """A CA that did not sign the server's certificate."""
    cert, _ = pki.make_ca("not the pool's", now=dt.datetime.now(dt.UTC))
    (tmp_path / "other-ca.pem").write_bytes(cert)
    return tmp_path / "other-ca.pem"


@pytest.fixture
async def tls_port(tmp_path: Path) -> AsyncIterator[int]:
    """A TLS server on 127.0.0.1 whose certificate comes from its own fresh CA."""
    now = dt.datetime.now(dt.UTC)
    ca_cert, ca_key = pki.make_ca("test", now=now)
    cert, key = pki.issue_server_cert(
        ca_cert,
        ca_key,
        common_name="server",
        dns_names=["localhost"],
        ip_addresses=["127.0.0.1"],
        now=now,
    )
    (tmp_path / "server.pem").write_bytes(cert)
    (tmp_path / "server.key").write_bytes(key)
    context = tls.server_context(tmp_path / "server.pem", tmp_path / "server.key")

    async def handshake(stream: trio.SSLStream[trio.SocketStream]) -> None:
        try:
            await stream.receive_some()
        except trio.BrokenResourceError:
            pass  # the client gave up on our certificate

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_ssl_over_tcp, handshake, 0, context, host="127.0.0.1")
        )
        yield listeners[0].transport_listener.socket.getsockname()[1]
        nursery.cancel_scope.cancel()


async def _async_failure(
    url: str, *, http_timeout: float = 5.0, verify: object = True
) -> Exception:
    async with httpx.AsyncClient(verify=verify, timeout=http_timeout) as client:  # type: ignore[arg-type]
        with pytest.raises(httpx.HTTPError) as info:
            await client.get(url)
    return info.value


def _sync_failure(url: str, *, timeout: float = 5.0, verify: object = True) -> Exception:
    with httpx.Client(verify=verify, timeout=timeout) as client:  # type: ignore[arg-type]
        with pytest.raises(httpx.HTTPError) as info:
            client.get(url)
    return info.value


async def test_connection_refused(closed_port: int) -> None:
    exc = await _async_failure(f"http://127.0.0.1:{closed_port}/")
    said = describe(exc)
    # trio's "all attempts to connect ... failed" hides the refusal inside an exception group.
    assert said.startswith(f"ConnectError: all attempts to connect to 127.0.0.1:{closed_port}")
    assert "ConnectionRefusedError" in said and "Connection refused" in said, said
    assert not untrusted(exc)

    exc = await trio.to_thread.run_sync(_sync_failure, f"http://127.0.0.1:{closed_port}/")
    assert describe(exc) == "ConnectError: [Errno 111] Connection refused"


async def test_certificate_not_trusted(tls_port: int, other_ca: Path) -> None:
    verify = tls.client_context(other_ca)
    exc = await _async_failure(f"https://127.0.0.1:{tls_port}/", verify=verify)
    assert str(exc) == ""  # what made the log lines say "failed: ;"
    said = describe(exc)
    assert said.startswith(f"ConnectError: {TRUST}: [SSL: CERTIFICATE_VERIFY_FAILED]"), said
    assert untrusted(exc)

    exc = await trio.to_thread.run_sync(
        partial(_sync_failure, f"https://127.0.0.1:{tls_port}/", verify=verify)
    )
    assert describe(exc).startswith(f"ConnectError: {TRUST}: [SSL: CERTIFICATE_VERIFY_FAILED]")
    assert untrusted(exc)


async def test_read_timeout_says_how_long(silent_port: int) -> None:
    exc = await _async_failure(f"http://127.0.0.1:{silent_port}/", http_timeout=0.2)
    assert isinstance(exc, httpx.ReadTimeout) and str(exc) == ""
    # Not the "cancelled due to deadline" of the trio.Cancelled deep in its causes.
    assert describe(exc) == "ReadTimeout (no answer within 0.2 s)"

    exc = await trio.to_thread.run_sync(
        partial(_sync_failure, f"http://127.0.0.1:{silent_port}/", timeout=0.2)
    )
    assert describe(exc) == "ReadTimeout: timed out (no answer within 0.2 s)"


async def test_timeouts_with_no_text_are_named() -> None:
    with pytest.raises(trio.TooSlowError) as info:
        with trio.fail_after(0):
            await trio.sleep(1)
    assert describe(info.value) == "TooSlowError"
    assert describe(TimeoutError()) == "TimeoutError"
    # An httpx timeout raised without a request cannot say how long it waited.
    assert describe(httpx.ReadTimeout("")) == "ReadTimeout"


async def test_exception_group_is_summarized() -> None:
    async def fail(exc: Exception) -> None:
        raise exc

    with pytest.raises(ExceptionGroup) as info:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fail, ValueError("one"))
            nursery.start_soon(fail, httpx.ConnectError(""))
    said = describe(info.value)
    assert said.startswith("ExceptionGroup: ")
    assert "ValueError: one" in said and "ConnectError" in said, said


def test_groups_are_bounded_and_repeats_counted() -> None:
    group = ExceptionGroup("many", [OSError(f"disk {i} failed") for i in range(50)])
    said = describe(group)
    assert said == (
        "ExceptionGroup: many (OSError: disk 0 failed; OSError: disk 1 failed; "
        "OSError: disk 2 failed; and 47 more)"
    )
    same = ExceptionGroup("", [TimeoutError(), TimeoutError(), KeyError("k")])
    assert describe(same) == "ExceptionGroup (TimeoutError (2 times); KeyError: 'k')"
    nested: BaseException = ValueError("bottom")
    for _ in range(10):
        nested = ExceptionGroup("level", [nested])
    assert len(describe(nested)) < MAX_CHARS


def test_empty_text_takes_the_first_cause_that_has_one() -> None:
    try:
        try:
            raise ConnectionResetError(104, "Connection reset by peer")
        except ConnectionResetError as inner:
            raise trio.BrokenResourceError from inner
    except trio.BrokenResourceError as outer:
        exc = outer
    assert describe(exc) == "BrokenResourceError: [Errno 104] Connection reset by peer"


def test_never_empty_bounded_and_safe_on_cycles() -> None:
    assert describe(Exception()) == "Exception"
    assert describe(RuntimeError("RuntimeError")) == "RuntimeError"
    long = describe(ValueError("x" * 10_000))
    assert len(long) == MAX_CHARS and long.startswith("ValueError: xxx") and long.endswith("…")
    a, b = RuntimeError(), KeyError()
    a.__context__, b.__context__ = b, a
    assert describe(a) == "RuntimeError"
