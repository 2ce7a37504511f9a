"""The real ``vpool-coordinator`` process: HTTPS on 127.0.0.1 port 0, ready file, SIGTERM."""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from vpool import tls
from vpool.protocol import pki

DEADLINE = 30.0


pytestmark = pytest.mark.large


def _command() -> list[str]:
    script = Path(sys.executable).with_name("vpool-coordinator")
    if script.exists():
        return [str(script)]
    found = shutil.which("vpool-coordinator")
    return [found] if found else [sys.executable, "-m", "vpool.coordinator.cli"]


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VPOOL_")}
    env["VPOOL_HOME"] = str(tmp_path / "home")
    return env


def _pool_files(tmp_path: Path) -> tuple[Path, Path]:
    now = dt.datetime.now(dt.UTC)
    ca_cert, ca_key = pki.make_ca("test", now=now)
    cert, key = pki.issue_server_cert(
        ca_cert,
        ca_key,
        common_name="coordinator",
        dns_names=["localhost"],
        ip_addresses=["127.0.0.1"],
        now=now,
    )
    (tmp_path / "ca.pem").write_bytes(ca_cert)
    (tmp_path / "cert.pem").write_bytes(cert)
    (tmp_path / "key.pem").write_bytes(key)
    config = tmp_path / "coordinator.toml"
    config.write_text(
        f'host = "127.0.0.1"\nport = 0\nstate_dir = "{tmp_path / "state"}"\n'
        f'tls_cert = "{tmp_path / "cert.pem"}"\ntls_key = "{tmp_path / "key.pem"}"\n'
        'pool_name = "serve-test"\n'
    )
    return config, tmp_path / "ca.pem"


def _wait_ready(proc: subprocess.Popen[bytes], ready: Path) -> dict[str, object]:
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        if ready.exists():
            info: dict[str, object] = json.loads(ready.read_text())
            return info
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    out, err = proc.communicate()
    pytest.fail(f"coordinator did not become ready:\n{out.decode()}\n{err.decode()}")


def test_serve_https_port_zero(tmp_path: Path) -> None:
    config, ca = _pool_files(tmp_path)
    env = _env(tmp_path)
    token = (
        subprocess.run(
            [*_command(), "user", "add", "alice", "--config", str(config)],
            env=env,
            capture_output=True,
            check=True,
            timeout=DEADLINE,
        )
        .stdout.decode()
        .strip()
    )
    assert token

    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [*_command(), "serve", "--config", str(config), "--ready-file", str(ready)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        info = _wait_ready(proc, ready)
        assert info["host"] == "127.0.0.1" and info["pid"] == proc.pid
        port = info["port"]
        assert isinstance(port, int) and port > 0
        assert info["url"] == f"https://127.0.0.1:{port}"
        with httpx.Client(
            base_url=str(info["url"]), verify=tls.client_context(ca), timeout=10
        ) as client:
            pool = client.get("/api/v1/pool")
            assert pool.status_code == 200 and pool.json()["name"] == "serve-test"
            who = client.get("/api/v1/whoami", headers={"Authorization": f"Bearer {token}"})
            assert who.json() == {"name": "alice", "role": "user"}
            page = client.get("/", follow_redirects=True)  # signed out: the sign-in page
            assert page.status_code == 200 and "serve-test" in page.text
            assert page.url.path == "/login" and 'name="token"' in page.text
            missing = client.get("/api/v1/jobs/1", headers={"Authorization": f"Bearer {token}"})
            assert missing.status_code == 404 and missing.json()["error"]["code"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=DEADLINE) == 0
        assert not ready.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        out, err = proc.communicate()
        print(out.decode(), err.decode())


def test_serve_refuses_plain_http(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'state_dir = "{tmp_path / "state"}"\nport = 0\n')
    r = subprocess.run(
        [*_command(), "serve", "--config", str(config)],
        env=_env(tmp_path),
        capture_output=True,
        timeout=DEADLINE,
    )
    assert r.returncode == 1
    assert b"refusing to serve plain HTTP" in r.stderr


def test_cli_help_has_examples(tmp_path: Path) -> None:
    for args in ([], ["serve"], ["user"], ["user", "add"], ["init"]):
        r = subprocess.run(
            [*_command(), *args, "--help"],
            env=_env(tmp_path),
            capture_output=True,
            timeout=DEADLINE,
            check=True,
        )
        assert b"Example" in r.stdout or args == ["user"], (args, r.stdout)


def test_init_and_duplicate_user(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    env = _env(tmp_path)
    r = subprocess.run(
        [*_command(), "init", "--config", str(config)],
        env=env,
        capture_output=True,
        timeout=DEADLINE,
        check=True,
    )
    assert b"signing key" in r.stdout
    assert (tmp_path / "state" / "signing.key").exists()
    add = [*_command(), "user", "add", "bob", "--config", str(config)]
    subprocess.run(add, env=env, capture_output=True, timeout=DEADLINE, check=True)
    again = subprocess.run(add, env=env, capture_output=True, timeout=DEADLINE)
    assert again.returncode == 1 and b"already exists" in again.stderr
