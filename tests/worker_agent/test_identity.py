from __future__ import annotations

import stat
from pathlib import Path

import httpx
import pytest

from vpool.protocol import tokens
from vpool.worker_agent.agent import enroll
from vpool.worker_agent.coordinator import CoordinatorClient
from vpool.worker_agent.errors import AgentError, CoordinatorRejected
from vpool.worker_agent.identity import KEY_FILE, load_or_create_key
from vpool.worker_agent.settings import AgentSettings

from .conftest import AGENT_TOKEN, FakeCoordinator


def test_key_created_private_and_reused(tmp_path: Path) -> None:
    key = load_or_create_key(tmp_path / "id")
    path = tmp_path / "id" / KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "id").stat().st_mode) == 0o700
    again = load_or_create_key(tmp_path / "id")
    assert tokens.public_key_text(again.public_key()) == tokens.public_key_text(key.public_key())
    assert list((tmp_path / "id").iterdir()) == [path]


def test_damaged_key_is_an_error(tmp_path: Path) -> None:
    (tmp_path / KEY_FILE).write_bytes(b"not a key")
    with pytest.raises(AgentError, match="not an Ed25519 private key"):
        load_or_create_key(tmp_path)


async def test_enroll_proves_possession_and_keeps_token(
    settings: AgentSettings, coordinator: FakeCoordinator
) -> None:
    key = load_or_create_key(settings.identity_path)
    async with CoordinatorClient(
        "https://c.invalid", transport=httpx.MockTransport(coordinator.handle)
    ) as client:
        enrolled = await enroll(settings, client, key)
    assert enrolled.agent_id == "agent-1"
    assert client.token == AGENT_TOKEN
    [req] = coordinator.enrolls
    assert req.public_key == tokens.public_key_text(key.public_key())
    assert (req.name, req.slots) == ("test-agent", 4)
    assert req.software.startswith("vpool-agent")


async def test_enroll_retries_while_coordinator_is_down(
    settings: AgentSettings, coordinator: FakeCoordinator, autojump_clock: object
) -> None:
    coordinator.fail_next = 3
    key = load_or_create_key(settings.identity_path)
    async with CoordinatorClient(
        "https://c.invalid", transport=httpx.MockTransport(coordinator.handle)
    ) as client:
        enrolled = await enroll(settings, client, key)
    assert enrolled.agent_token == AGENT_TOKEN
    assert len(coordinator.enrolls) == 1


async def test_enroll_refused_is_final(settings: AgentSettings) -> None:
    async def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            403, json={"error": {"code": "bad_secret", "message": "wrong enroll secret"}}
        )

    key = load_or_create_key(settings.identity_path)
    async with CoordinatorClient(
        "https://c.invalid", transport=httpx.MockTransport(refuse)
    ) as client:
        with pytest.raises(CoordinatorRejected, match="wrong enroll secret") as info:
            await enroll(settings, client, key)
    assert info.value.status == 403 and info.value.code == "bad_secret"
