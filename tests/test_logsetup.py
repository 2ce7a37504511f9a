"""After the processes' logging set-up a routine request logs nothing at INFO (httpx logs each
one otherwise), while a failed one still reaches the log, named, through its caller."""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator, Iterator
from functools import partial

import httpx
import pytest
import trio

from vpool.logsetup import CHATTY, quiet_routine_requests
from vpool.reasons import describe


@pytest.fixture(autouse=True)
def _restore_levels() -> Iterator[None]:
    """The libraries' loggers as a new process has them (an earlier test in this process
    may have quieted them), and as they were again afterwards."""
    levels = {name: logging.getLogger(name).level for name in CHATTY}
    for name in CHATTY:
        logging.getLogger(name).setLevel(logging.NOTSET)
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


@pytest.fixture
async def ok_url() -> AsyncIterator[str]:
    """An HTTP server on 127.0.0.1 answering every request 200 with an empty body."""

    async def answer(stream: trio.SocketStream) -> None:
        got = b""
        while b"\r\n\r\n" not in got:
            chunk = await stream.receive_some()
            if not chunk:
                return
            got += chunk
        await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(partial(trio.serve_tcp, answer, 0, host="127.0.0.1"))
        port = listeners[0].socket.getsockname()[1]
        yield f"http://127.0.0.1:{port}/api/v1/agents/heartbeat"
        nursery.cancel_scope.cancel()


def _from_http_libraries(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.split(".")[0] in CHATTY]


async def test_routine_requests_are_not_logged(
    ok_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with httpx.AsyncClient() as client:
        (await client.post(ok_url)).raise_for_status()
        # What an agent logged for every heartbeat before.
        said = [r.getMessage() for r in _from_http_libraries(caplog) if r.levelno == logging.INFO]
        assert said == [f'HTTP Request: POST {ok_url} "HTTP/1.1 200 OK"']

        caplog.clear()
        quiet_routine_requests()
        (await client.post(ok_url)).raise_for_status()
        assert _from_http_libraries(caplog) == []

        quiet_routine_requests(verbose=True)  # -v: all of it again, for debugging
        (await client.post(ok_url)).raise_for_status()
        assert any(r.levelno == logging.INFO for r in _from_http_libraries(caplog))


@pytest.mark.medium
async def test_a_failed_request_is_logged_with_its_type(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    quiet_routine_requests()
    log = logging.getLogger("vpool.test")
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused
        url = f"http://127.0.0.1:{closed.getsockname()[1]}/api/v1/agents/heartbeat"
        async with httpx.AsyncClient() as client:
            try:
                await client.post(url)
            except httpx.HTTPError as exc:
                log.warning("heartbeat failed: %s", describe(exc))
    assert _from_http_libraries(caplog) == []
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().startswith("heartbeat failed: ConnectError: ")
    assert "Connection refused" in record.getMessage()
