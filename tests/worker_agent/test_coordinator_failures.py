"""The agent's coordinator client against a real socket that fails: its log lines and errors
name the failure ("ConnectError: ..."), never an empty reason ("failed: ;")."""

from __future__ import annotations

import datetime as dt
import logging
import socket
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import pytest
import trio

from vpool import tls
from vpool.protocol import api, pki
from vpool.worker_agent.coordinator import CoordinatorClient
from vpool.worker_agent.errors import CoordinatorUntrusted

from .conftest import Pki


class _StopAtFirstWarning(logging.Handler):
    """Keeps the records and cancels ``scope`` at the first warning: the client retries for
    ever, and the test needs only its first say."""

    def __init__(self, scope: trio.CancelScope) -> None:
        super().__init__(logging.WARNING)
        self.scope = scope
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.scope.cancel()


@pytest.mark.medium
async def test_an_unreachable_coordinator_is_logged_with_the_reason() -> None:
    log = logging.getLogger("vpool.agent")
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, not listening: refused
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        async with CoordinatorClient(url) as client:
            with trio.fail_after(10), trio.CancelScope() as scope:
                seen = _StopAtFirstWarning(scope)
                log.addHandler(seen)
                try:
                    await client.post_problem(
                        api.RankProblem(job=1, rank=0, incarnation=1, message="relay gone")
                    )
                finally:
                    log.removeHandler(seen)
    [record] = seen.records
    said = record.getMessage()
    assert said.startswith(f"reporting a rank problem: POST {url}/api/v1/agents/problem failed: ")
    assert "ConnectError: " in said and "Connection refused" in said, said
    assert said.endswith("; retrying in 0.2 s")


@pytest.fixture
async def https_url(pool_pki: Pki) -> AsyncIterator[str]:
    """A TLS server with the pool's certificate that only handshakes."""

    async def handshake(stream: trio.SSLStream[trio.SocketStream]) -> None:
        try:
            await stream.receive_some()
        except trio.BrokenResourceError:
            pass

    context = tls.server_context(pool_pki.cert, pool_pki.key)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            partial(trio.serve_ssl_over_tcp, handshake, 0, context, host="127.0.0.1")
        )
        yield f"https://127.0.0.1:{listeners[0].transport_listener.socket.getsockname()[1]}"
        nursery.cancel_scope.cancel()


async def test_an_untrusted_coordinator_is_named_at_once(https_url: str, tmp_path: Path) -> None:
    other, _ = pki.make_ca("not the pool's", now=dt.datetime.now(dt.UTC))
    (tmp_path / "other-ca.pem").write_bytes(other)
    req = api.EnrollRequest(public_key="k", timestamp=0.0, signature="s", name="a", slots=1)
    async with CoordinatorClient(https_url, ca=tmp_path / "other-ca.pem") as client:
        with trio.fail_after(10), pytest.raises(CoordinatorUntrusted) as info:
            await client.enroll(req)
    said = str(info.value)
    assert said.startswith(
        f"POST {https_url}/api/v1/agents/enroll: ConnectError: TLS certificate not trusted: "
        "[SSL: CERTIFICATE_VERIFY_FAILED]"
    ), said
    assert said.endswith("; check the agent's `ca` setting")
