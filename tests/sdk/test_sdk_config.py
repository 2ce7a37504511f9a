"""The client config and the small TOML writer."""

from __future__ import annotations

import stat
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from vpool import paths
from vpool.sdk import clientconfig, toml
from vpool.sdk.cli import cli
from vpool.sdk.client import Client
from vpool.sdk.errors import ConfigError


def test_round_trip_and_private_mode(home: Path) -> None:
    ca = home / "ca.pem"
    cfg = clientconfig.ClientConfig(url="https://127.0.0.1:8443", token="t0k", ca=ca)
    path = clientconfig.save(cfg)
    assert path == paths.client_config_file()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert clientconfig.load() == cfg


def test_trailing_slash_and_relative_ca(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('url = "https://x:1/"\ntoken = "t"\nca = "ca.pem"\n')
    assert clientconfig.load(path) == clientconfig.ClientConfig(
        "https://x:1", "t", tmp_path / "ca.pem"
    )


def test_missing_config_says_what_to_do(home: Path) -> None:
    with pytest.raises(ConfigError, match="vsdk login"):
        clientconfig.load()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("url = ", "cannot read"),
        ('url = "https://x"\nport = 3\n', "unknown setting"),
        ("token = 'x'\n", "url"),
        ('url = "https://x"\ntoken = 3\n', "token"),
    ],
)
def test_malformed_config(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        clientconfig.load(path)


def test_explicit_url_needs_no_config(home: Path) -> None:
    with Client.from_config(url="http://h:1", token="t") as c:
        assert c.url == "http://h:1"


values = st.one_of(
    st.text(),
    st.integers(-(2**63), 2**63 - 1),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(st.text(), max_size=3),
)


@given(st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True), values))
def test_toml_writer_round_trips(data: dict) -> None:  # type: ignore[type-arg]
    assert tomllib.loads(toml.dumps(data)) == data


def test_login_without_check_writes_the_config(home: Path, tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    res = CliRunner().invoke(
        cli,
        ["login", "https://pool.example:8443/", "--token", "abc", "--ca", str(ca), "--no-check"],
    )
    assert res.exit_code == 0, res.output
    assert clientconfig.load() == clientconfig.ClientConfig(
        "https://pool.example:8443", "abc", ca.resolve()
    )


def test_login_checks_the_token(coord, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    import vpool.sdk.client as client_mod

    monkeypatch.setattr(client_mod, "Client", lambda url, token, ca=None: coord.client(token))
    res = CliRunner().invoke(cli, ["login", "http://coord.test", "--token", "wrong"])
    assert res.exit_code == 5
    assert "unknown API token" in res.stderr
    res = CliRunner().invoke(cli, ["login", "http://coord.test", "--token", "secret-token"])
    assert res.exit_code == 0, res.stderr
    assert "as alice" in res.stderr
    assert clientconfig.load().token == "secret-token"


def test_login_refuses_a_url_without_scheme(home: Path) -> None:
    res = CliRunner().invoke(cli, ["login", "pool.example", "--token", "x", "--no-check"])
    assert res.exit_code == 2
