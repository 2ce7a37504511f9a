"""``vpool-agent`` as a real process against the fake coordinator served over HTTPS."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio
from click.testing import CliRunner

from vpool.worker_agent.cli import main
from vpool.worker_agent.settings import AgentSettings

from .conftest import FakeCoordinator, Pki, host_pid, lease_for, lines


def test_help_has_an_example() -> None:
    result = CliRunner().invoke(main, ["--help"])
    assert result.exit_code == 0
    assert "Example:" in result.output and "vpool-agent --config" in result.output
    for flag in ("--config", "--ready-file", "--slots", "--name", "--work-dir", "--identity-dir"):
        assert flag in result.output


def test_missing_config_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["--config", str(tmp_path / "nope.toml")])
    assert result.exit_code == 2 and "does not exist" in result.output


async def test_sigterm_kills_ranks_and_exits_zero(
    https_coordinator: str,
    coordinator: FakeCoordinator,
    pool_pki: Pki,
    settings: AgentSettings,
    tmp_path: Path,
) -> None:
    ready = tmp_path / "ready.json"
    env = {
        **os.environ,
        "VPOOL_AGENT_COORDINATOR_URL": https_coordinator,
        "VPOOL_AGENT_COORDINATOR_CA": str(pool_pki.ca),
    }
    cmd = [
        sys.executable,
        "-m",
        "vpool.worker_agent.cli",
        "--ready-file",
        str(ready),
        "--slots",
        "2",
        "--name",
        "cli-agent",
        "--work-dir",
        settings.work_dir,
        "--identity-dir",
        settings.identity_dir,
    ]
    proc = await trio.lowlevel.open_process(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        await coordinator.wait_for(lambda: ready.exists())
        info = json.loads(ready.read_text())
        assert info == {"pid": proc.pid, "agent_id": "agent-1", "name": "cli-agent"}
        assert coordinator.enrolls[0].slots == 2
        coordinator.add_lease(lease_for(coordinator, None, args=["hang"]))
        [rank] = await coordinator.wait_for(
            lambda: [x for x in lines(coordinator.output_of(7, 0)) if "pid" in x]
        )
        rank_pid = host_pid(rank["pid"], 7, 0)
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(15):
            code = await proc.wait()
        assert code == 0, await _output(proc)
        try:
            os.kill(rank_pid, 0)
        except ProcessLookupError:
            pass
        else:
            raise AssertionError("the rank survived its agent")
        [problem] = coordinator.problems
        assert "agent cli-agent is shutting down" in problem.message
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if proc.stdout is not None:
            await proc.stdout.aclose()


async def _output(proc: trio.Process) -> str:
    assert proc.stdout is not None
    data = b""
    with trio.move_on_after(2):
        while chunk := await proc.stdout.receive_some(65536):
            data += chunk
    return data.decode(errors="replace")


def _agent_cmd(settings: AgentSettings, url: str, ca: Path) -> tuple[list[str], dict[str, str]]:
    env = {
        **os.environ,
        "VPOOL_AGENT_COORDINATOR_URL": url,
        "VPOOL_AGENT_COORDINATOR_CA": str(ca),
        "VPOOL_AGENT_RETRY_MAX_DELAY": "0.5",
    }
    cmd = [
        sys.executable,
        "-m",
        "vpool.worker_agent.cli",
        "--slots",
        "1",
        "--work-dir",
        settings.work_dir,
        "--identity-dir",
        settings.identity_dir,
    ]
    return cmd, env


async def test_a_coordinator_it_cannot_trust_is_said_at_once(
    https_coordinator: str, settings: AgentSettings, tmp_path: Path
) -> None:
    import datetime as dt

    from vpool.protocol import pki

    other, _ = pki.make_ca("not the pool's", now=dt.datetime.now(dt.UTC))
    (tmp_path / "other-ca.pem").write_bytes(other)
    cmd, env = _agent_cmd(settings, https_coordinator, tmp_path / "other-ca.pem")
    with trio.fail_after(30):
        done = await trio.run_process(cmd, env=env, capture_stderr=True, check=False)
    said = done.stderr.decode()
    assert done.returncode == 1, said
    assert "TLS certificate not trusted" in said and "`ca` setting" in said
    assert "failed: ;" not in said and "ConnectError('')" not in said


@pytest.mark.large
async def test_sigterm_while_enrolling_exits_at_once(
    settings: AgentSettings, pool_pki: Pki, tmp_path: Path
) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on: the coordinator is "down"
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd, env = _agent_cmd(settings, f"https://127.0.0.1:{port}", pool_pki.ca)
    proc = await trio.lowlevel.open_process(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    assert proc.stdout is not None
    try:
        seen = b""
        with trio.fail_after(30):
            while b"retrying" not in seen:  # it tries to enroll, and will again
                seen += await proc.stdout.receive_some(65536)
        assert b"Connection refused" in seen or b"connect" in seen.lower()
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(10):
            code = await proc.wait()
        assert code == 0, await _output(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await proc.stdout.aclose()
