"""The pool CA for volunteers: the coordinator serves it to anyone at GET /api/v1/pool/ca (its
``tls_ca`` setting, which `init` sets), and `join-token create` prints the whole command a
volunteer joins with, the CA's digest in it (`vpool-agent join URL TOKEN --ca-sha256 HEX`)."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner
from coord_helpers import open_pool

from vpool.coordinator import cli
from vpool.coordinator.settings import load
from vpool.protocol import api, pki


def _ca(tmp_path: Path) -> Path:
    cert, _key = pki.make_ca("physics", now=dt.datetime.now(dt.UTC))
    path = tmp_path / "ca.pem"
    path.write_bytes(cert)
    return path


async def test_the_pool_ca_is_served_to_anyone(tmp_path: Path) -> None:
    ca = _ca(tmp_path)
    async with open_pool(tmp_path, tls_ca=str(ca)) as pool:
        r = await pool.client.get("/api/v1/pool/ca")  # no credentials
        assert r.status_code == 200, r.text
        assert r.content == ca.read_bytes()
        assert r.headers["content-type"] == "application/x-pem-file"
        ca.unlink()
        r = await pool.client.get("/api/v1/pool/ca")
        assert r.status_code == 404
        assert msgspec.json.decode(r.content, type=api.ErrorBody).error.code == "no_ca"


async def test_no_ca_is_served_without_tls_ca(tmp_path: Path) -> None:
    async with open_pool(tmp_path) as pool:
        r = await pool.client.get("/api/v1/pool/ca")
        assert r.status_code == 404
        error = msgspec.json.decode(r.content, type=api.ErrorBody).error
        assert error.code == "no_ca" and "tls_ca" in error.message


@pytest.mark.large
def test_fingerprint_is_what_openssl_shows(tmp_path: Path) -> None:
    ca = _ca(tmp_path)
    digest = pki.fingerprint(ca.read_bytes())
    assert len(digest) == 64 and digest == digest.lower()
    assert pki.is_ca(ca.read_bytes())
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl to compare with")
    out = subprocess.run(
        [openssl, "x509", "-noout", "-fingerprint", "-sha256", "-in", str(ca)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip().split("=", 1)[1].replace(":", "").lower() == digest


def _create(config: Path) -> tuple[str, str]:
    res = CliRunner().invoke(
        cli.main, ["join-token", "create", "--uses", "3", "--config", str(config)]
    )
    assert res.exit_code == 0, res.output
    return res.stdout.strip(), res.stderr


def test_join_token_create_prints_the_join_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in [v for v in os.environ if v.startswith("VPOOL_")]:
        monkeypatch.delenv(var)
    pool = tmp_path / "pool"
    res = CliRunner().invoke(
        cli.main, ["init", "--public-url", "https://pool.example.org:8443", "--dir", str(pool)]
    )
    assert res.exit_code == 0, res.output
    assert "it prints the `vpool-agent join` command" in res.stdout
    config = pool / "coordinator.toml"
    assert load(config).tls_ca == str(pool / "ca.pem")

    token, said = _create(config)
    digest = pki.fingerprint((pool / "ca.pem").read_bytes())
    assert token.startswith("vpj_")  # stdout is the token alone, for scripts
    assert (
        f"\n  vpool-agent join https://pool.example.org:8443 {token} --ca-sha256 {digest}\n" in said
    )

    # A pool that does not say its URL or CA: the command with what to fill in.
    bare = tmp_path / "bare.toml"
    bare.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    token, said = _create(bare)
    assert f"vpool-agent join https://HOST:PORT {token} --ca ca.pem\n" in said
    assert "no public_url is set" in said and "tls_ca does not name the pool CA" in said
