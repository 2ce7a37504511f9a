"""``vpool-relay`` as a command: help, refusing bad settings with exit code 1."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from relay_fakes import Pool

BIN = Path(sys.executable).parent


pytestmark = pytest.mark.large


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "vpool-relay"), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_help_shows_an_example() -> None:
    out = run("--help")
    assert out.returncode == 0
    assert "Example:" in out.stdout and "--ready-file" in out.stdout


def test_refuses_to_run_without_tls(tmp_path: Path) -> None:
    out = run("--port", "0", "--data-dir", str(tmp_path), env={"VPOOL_RELAY_SIGNING_KEY": "x"})
    assert out.returncode == 1
    assert "tls_cert" in out.stderr


def test_refuses_an_unusable_data_dir(pool: Pool, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    env = {
        "VPOOL_RELAY_TLS_CERT": str(pool.cert),
        "VPOOL_RELAY_TLS_KEY": str(pool.cert_key),
        "VPOOL_RELAY_SIGNING_KEY": pool.public_key_text,
    }
    out = run("--port", "0", "--data-dir", str(blocker / "data"), env=env)
    assert out.returncode == 1
    assert "data directory" in out.stderr


def test_bad_setting_value(tmp_path: Path) -> None:
    config = tmp_path / "relay.toml"
    config.write_text('push_window = "lots"\n')
    out = run("--config", str(config))
    assert out.returncode == 1
    assert "push_window" in out.stderr
