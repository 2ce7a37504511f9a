"""Operator commands: `vpool-coordinator init --public-url` makes a pool (CA, the coordinator's
certificate and settings), `relay add --address` a relay's bundle, and the servers refuse to
advertise a name their certificate does not have."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner, Result
from cryptography import x509

from vpool import tls
from vpool.coordinator import cli, keys, pooldir
from vpool.coordinator.settings import CoordinatorSettings
from vpool.coordinator.settings import load as load_coordinator
from vpool.coordinator.sqlite_store import SqliteStore
from vpool.protocol import pki
from vpool.relay.cli import checked_advertise
from vpool.relay.errors import RelayError
from vpool.relay.settings import RelaySettings
from vpool.relay.settings import load as load_relay

BIN = Path(sys.executable).parent
DEADLINE = 30.0
NOW = dt.datetime.now(dt.UTC)


@pytest.fixture(autouse=True)
def _home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for var in [v for v in os.environ if v.startswith("VPOOL_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("VPOOL_HOME", str(tmp_path / "home"))


def run(*args: str) -> Result:
    return CliRunner().invoke(cli.main, list(args))


def ok(*args: str) -> str:
    res = run(*args)
    assert res.exit_code == 0, res.output
    return res.stdout


def init(pool: Path, url: str, *more: str) -> str:
    return ok("init", "--public-url", url, "--dir", str(pool), *more)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def chains_to(cert: Path, ca: Path) -> bool:
    leaf = x509.load_pem_x509_certificate(cert.read_bytes())
    leaf.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.read_bytes()))
    return True


def env(tmp_path: Path, **extra: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VPOOL_")}
    return {**clean, "VPOOL_HOME": str(tmp_path / "home"), **extra}


# -- init -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "host"),
    [
        ("https://pool.example.org:8443", "pool.example.org"),
        ("https://192.0.2.10:9443/", "192.0.2.10"),
        ("https://[2001:db8::1]:8443", "2001:db8::1"),
    ],
)
def test_init_makes_a_pool(tmp_path: Path, url: str, host: str) -> None:
    pool = tmp_path / "pool"
    out = init(pool, url, "--pool-name", "physics")
    assert "relay add" in out and "join-token create" in out and "vpool-coordinator serve" in out
    assert f"--config {pool / 'coordinator.toml'}" in out

    assert mode(pool) == 0o700
    assert mode(pool / "ca.key") == mode(pool / "key.pem") == 0o600
    assert mode(pool / "state") == 0o700
    assert (pool / "state" / "vpool.db").exists() and (pool / "state" / "signing.key").exists()
    cert = (pool / "cert.pem").read_bytes()
    assert pki.cert_names(cert) == [host]
    assert pki.covers(cert, host) and not pki.covers(cert, "localhost")
    assert chains_to(pool / "cert.pem", pool / "ca.pem")

    settings = load_coordinator(pool / "coordinator.toml")
    assert isinstance(settings, CoordinatorSettings)
    assert settings.public_url == url.rstrip("/") and settings.pool_name == "physics"
    assert (settings.host, settings.port) == ("0.0.0.0", int(url.rstrip("/").rsplit(":", 1)[1]))
    assert (settings.tls_cert, settings.tls_key) == (str(pool / "cert.pem"), str(pool / "key.pem"))
    assert settings.state_path() == pool / "state"


def test_init_refuses_an_existing_pool_without_force(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    init(pool, "https://pool.example.org")
    assert load_coordinator(pool / "coordinator.toml").port == 443
    config = str(pool / "coordinator.toml")
    ok("user", "add", "alice", "--config", config)
    ca = (pool / "ca.pem").read_bytes()

    again = run("init", "--public-url", "https://other.example.org:8443", "--dir", str(pool))
    assert again.exit_code == 1 and "holds a pool already" in again.output
    assert "--force" in again.output and (pool / "ca.pem").read_bytes() == ca

    init(pool, "https://other.example.org:8443", "--force", "--host", "192.0.2.1")
    assert (pool / "ca.pem").read_bytes() != ca
    assert pki.covers((pool / "cert.pem").read_bytes(), "other.example.org")
    assert load_coordinator(pool / "coordinator.toml").host == "192.0.2.1"
    assert "alice\tuser" in ok("user", "list", "--config", config)  # the database is kept


def test_cert_renew_makes_a_new_certificate_from_the_same_ca(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    init(pool, "https://pool.example.org:8443")
    config = str(pool / "coordinator.toml")
    ca, old_cert, old_key = (
        (pool / name).read_bytes() for name in ("ca.pem", "cert.pem", "key.pem")
    )
    out = ok("cert", "renew", "--config", config)
    assert f"new certificate for pool.example.org in {pool / 'cert.pem'}" in out
    assert "restart the coordinator" in out
    cert = (pool / "cert.pem").read_bytes()
    assert cert != old_cert and (pool / "key.pem").read_bytes() != old_key
    assert (pool / "ca.pem").read_bytes() == ca  # volunteers keep their ca.pem
    assert mode(pool / "key.pem") == 0o600
    assert pki.cert_names(cert) == ["pool.example.org"]
    assert chains_to(pool / "cert.pem", pool / "ca.pem")
    leaf = x509.load_pem_x509_certificate(cert)
    assert leaf.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier)
    (pool / "ca.key").unlink()  # a copy of the settings elsewhere: no CA key to sign with
    res = run("cert", "renew", "--config", config)
    assert res.exit_code == 1 and "no pool CA key" in res.output, res.output


def test_init_defaults_to_the_config_directory(tmp_path: Path) -> None:
    init_out = ok("init", "--public-url", "https://pool.example.org:8443")
    pool = tmp_path / "home" / "config" / "coordinator"
    assert f"made in {pool}" in init_out
    settings = load_coordinator(pool / "coordinator.toml")
    assert settings.state_path() == tmp_path / "home" / "state" / "coordinator"
    # Commands given no --config find that pool.
    ok("relay", "add", "relay-1", "--address", "relay.example.org:7700")
    assert (pool / "relays" / "relay-1" / "relay.toml").exists()
    assert "relay-1\tlive" in ok("relay", "list")


@pytest.mark.parametrize(
    "args",
    [
        ["--public-url", "http://pool.example.org:8443"],
        ["--public-url", "https://pool.example.org:99999"],
        ["--public-url", "https://pool.example.org:8443/api"],
        ["--dir", "somewhere"],
    ],
)
def test_init_refuses_bad_arguments(tmp_path: Path, args: list[str]) -> None:
    res = run("init", *args)
    assert res.exit_code != 0 and res.output
    assert not (tmp_path / "home" / "config" / "coordinator").exists()


# -- relay add --address ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "host"),
    [("relay1.example.org:7700", "relay1.example.org"), ("[2001:db8::7]:7701", "2001:db8::7")],
)
def test_relay_add_writes_a_bundle(tmp_path: Path, address: str, host: str) -> None:
    pool = tmp_path / "pool"
    init(pool, "https://pool.example.org:8443")
    config = str(pool / "coordinator.toml")
    out = ok("relay", "add", "relay-1", "--address", address, "--config", config)
    bundle = pool / "relays" / "relay-1"
    assert f"bundle written to {bundle}" in out and "/var/lib/vpool-relay" in out

    assert mode(bundle) == 0o700
    assert mode(bundle / "key.pem") == mode(bundle / "relay.toml") == 0o600
    assert (bundle / "ca.pem").read_bytes() == (pool / "ca.pem").read_bytes()
    cert = (bundle / "cert.pem").read_bytes()
    assert pki.cert_names(cert) == [host] and pki.covers(cert, host)
    assert chains_to(bundle / "cert.pem", pool / "ca.pem")

    relay = load_relay(bundle / "relay.toml")
    assert isinstance(relay, RelaySettings)
    install = pooldir.RELAY_INSTALL_DIR
    assert (relay.name, relay.host, relay.port) == ("relay-1", "0.0.0.0", int(address[-4:]))
    assert relay.advertise_host == host
    assert relay.coordinator_url == "https://pool.example.org:8443"
    assert relay.coordinator_ca == str(install / "ca.pem")
    assert (relay.tls_cert, relay.tls_key) == (str(install / "cert.pem"), str(install / "key.pem"))
    assert relay.data_dir == str(install / "data")
    assert relay.fsync  # an acknowledged message survives the relay machine losing power
    store = SqliteStore(pool / "state" / "vpool.db")
    try:
        assert store.relay_by_key_hash(keys.hash_token(relay.relay_key)) == "relay-1"
    finally:
        store.close()

    again = run("relay", "add", "relay-1", "--address", address, "--config", config)
    assert again.exit_code == 1 and "--rotate" in again.output
    ok("relay", "add", "relay-1", "--address", address, "--rotate", "--config", config)
    assert load_relay(bundle / "relay.toml").relay_key != relay.relay_key


def test_relay_add_address_needs_a_pool(tmp_path: Path) -> None:
    config = tmp_path / "plain.toml"
    config.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    res = run("relay", "add", "r1", "--address", "relay.example.org:7700", "--config", str(config))
    assert res.exit_code == 1 and "init --public-url" in res.output
    no_config = run("relay", "add", "r1", "--address", "relay.example.org:7700")
    assert no_config.exit_code == 1 and "init --public-url" in no_config.output
    # Without --address it still only prints a key.
    assert ok("relay", "add", "r1", "--config", str(config)).startswith("vpr_")
    bad = run("relay", "add", "r2", "--bundle", "x", "--config", str(config))
    assert bad.exit_code == 2 and "--address" in bad.output


def test_relay_add_refuses_a_bad_address(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    init(pool, "https://pool.example.org:8443")
    config = str(pool / "coordinator.toml")
    for address in ("relay.example.org", "relay.example.org:0", "relay.example.org:x"):
        res = run("relay", "add", "r1", "--address", address, "--config", config)
        assert res.exit_code == 1 and address in res.output
    assert not (pool / "relays" / "r1").exists()


# -- the relay's certificate check ------------------------------------------------------------


def _relay_cert(tmp_path: Path, names: list[str]) -> RelaySettings:
    ca_cert, ca_key = pki.make_ca("t", now=NOW)
    dns, ips = pki.split_names(names)
    cert, key = pki.issue_server_cert(
        ca_cert, ca_key, common_name="r", dns_names=dns, ip_addresses=ips, now=NOW
    )
    (tmp_path / "cert.pem").write_bytes(cert)
    (tmp_path / "key.pem").write_bytes(key)
    return RelaySettings(
        host="0.0.0.0",
        coordinator_url="https://pool.example.org:8443",
        tls_cert=str(tmp_path / "cert.pem"),
        tls_key=str(tmp_path / "key.pem"),
    )


def test_relay_on_every_address_takes_its_certificates_only_name(tmp_path: Path) -> None:
    settings = _relay_cert(tmp_path, ["relay.example.org"])
    assert checked_advertise(settings).advertise_host == "relay.example.org"


def test_relay_on_every_address_does_not_guess_between_names(tmp_path: Path) -> None:
    settings = _relay_cert(tmp_path, ["relay.example.org", "192.0.2.7"])
    with pytest.raises(RelayError, match="advertise_host is not set") as err:
        checked_advertise(settings)
    assert "relay.example.org, 192.0.2.7" in err.value.message
    named = dataclasses.replace(settings, advertise_host="192.0.2.7")
    assert checked_advertise(named) == named
    bound = dataclasses.replace(settings, host="192.0.2.8")
    with pytest.raises(RelayError) as err:
        checked_advertise(bound)
    assert "host 192.0.2.8 is not a name of the certificate" in err.value.message
    standalone = dataclasses.replace(settings, coordinator_url="")
    assert checked_advertise(standalone) == standalone  # it advertises nothing


@pytest.mark.large
def test_relay_process_refuses_an_advertise_host_its_certificate_lacks(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    init(pool, "https://pool.example.org:8443")
    bundle = tmp_path / "relay-1"
    ok("relay", "add", "relay-1", "--address", "relay.example.org:7700",
       "--bundle", str(bundle), "--install-dir", str(bundle),
       "--config", str(pool / "coordinator.toml"))  # fmt: skip
    toml = bundle / "relay.toml"
    toml.write_text(toml.read_text().replace('"relay.example.org"', '"elsewhere.example.org"'))
    res = subprocess.run(
        [str(BIN / "vpool-relay"), "--config", str(toml), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        env=env(tmp_path),
    )
    assert res.returncode == 1, res.stderr
    assert "advertise_host elsewhere.example.org is not a name of the certificate" in res.stderr
    assert "relay.example.org" in res.stderr


# -- a pool started from what the commands wrote ----------------------------------------------


def _wait_for(what: str, proc: subprocess.Popen[str], done: Callable[[], bool]) -> None:
    end = time.monotonic() + DEADLINE
    while time.monotonic() < end:
        if done():
            return
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    pytest.fail(f"{what} did not happen")


@contextmanager
def _process(argv: list[str], environ: dict[str, str]) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        argv, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=DEADLINE)
            except subprocess.TimeoutExpired:
                proc.kill()
        out, err = proc.communicate()
        print(argv[0], out, err, sep="\n")


@pytest.mark.large
def test_coordinator_and_relay_start_from_init_and_a_bundle(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    url = "https://127.0.0.1:8443"
    init(pool, url)
    config = pool / "coordinator.toml"
    bundle = tmp_path / "relay-1"
    ok("relay", "add", "relay-1", "--address", "127.0.0.1:7700", "--bundle", str(bundle),
       "--install-dir", str(bundle), "--config", str(config))  # fmt: skip
    ready = tmp_path / "coordinator.json"
    coordinator = [str(BIN / "vpool-coordinator"), "serve", "--config", str(config)]
    with _process(
        [*coordinator, "--host", "127.0.0.1", "--port", "0", "--ready-file", str(ready)],
        env(tmp_path),
    ) as proc:
        _wait_for("the coordinator's ready file", proc, ready.exists)
        info = json.loads(ready.read_text())
        assert info["url"] == url  # public_url, not the address it listens on
        real = f"https://127.0.0.1:{info['port']}"
        with httpx.Client(verify=tls.client_context(pool / "ca.pem"), timeout=10) as client:
            assert client.get(f"{real}/api/v1/pool").status_code == 200

        relay_ready = tmp_path / "relay.json"
        relay = [str(BIN / "vpool-relay"), "--config", str(bundle / "relay.toml")]
        relay_env = env(tmp_path, VPOOL_RELAY_COORDINATOR_URL=real)
        with _process(
            [*relay, "--port", "0", "--host", "127.0.0.1", "--ready-file", str(relay_ready)],
            relay_env,
        ) as relay_proc:
            store = SqliteStore(pool / "state" / "vpool.db")
            try:

                def registered() -> bool:
                    rows = {r["name"]: r for r in store.list_relay_keys()}
                    return rows["relay-1"]["state"] == "alive"

                _wait_for("the relay's registration", relay_proc, registered)
                row = next(r for r in store.list_relay_keys() if r["name"] == "relay-1")
                assert row["host"] == "127.0.0.1"
            finally:
                store.close()
            relay_proc.send_signal(signal.SIGTERM)
            assert relay_proc.wait(timeout=DEADLINE) == 0


@pytest.mark.large
def test_coordinator_refuses_a_public_url_its_certificate_lacks(tmp_path: Path) -> None:
    pool = tmp_path / "pool"
    init(pool, "https://pool.example.org:8443")
    config = pool / "coordinator.toml"
    config.write_text(config.read_text().replace("pool.example.org", "other.example.org"))
    res = subprocess.run(
        [str(BIN / "vpool-coordinator"), "serve", "--config", str(config), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        env=env(tmp_path),
    )
    assert res.returncode == 1
    assert "public_url https://other.example.org:8443 names other.example.org" in res.stderr
    assert "it names pool.example.org" in res.stderr
