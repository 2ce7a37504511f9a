"""The operator's pool directory, made by ``vpool-coordinator init --public-url``, and the
bundles ``vpool-coordinator relay add NAME --address`` makes from it for relays.

    DIR/coordinator.toml      the coordinator's settings (every command's --config)
    DIR/ca.pem                the pool CA: relays, volunteers and scientists trust it
    DIR/ca.key                the CA's private key (0600): it signs the servers' certificates
    DIR/cert.pem, key.pem     the coordinator's certificate, naming the host of public_url
    DIR/state/                the database, blobs and signing key (when DIR was given)
    DIR/relays/NAME/          a relay's bundle: relay.toml, cert.pem, key.pem, ca.pem

A bundle's settings name its files where the bundle will be on the relay machine
(``install_dir``, the relay service's state directory unless told otherwise), since a
settings file's relative paths are relative to the directory the relay starts in.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import tomli_w

from vpool import paths
from vpool.coordinator.errors import BadRequest, Conflict, NotFound
from vpool.coordinator.keys import write_private
from vpool.protocol import pki

SETTINGS_FILE = "coordinator.toml"
RELAY_SETTINGS_FILE = "relay.toml"
# Where packaging/vpool-relay.service keeps the relay's files (its StateDirectory).
RELAY_INSTALL_DIR = Path("/var/lib/vpool-relay")


def default_dir() -> Path:
    """The pool directory when ``init`` is given none (and where commands find the settings
    when given no --config)."""
    return paths.config_dir() / "coordinator"


@dataclass(frozen=True)
class PoolDir:
    root: Path

    @property
    def settings(self) -> Path:
        return self.root / SETTINGS_FILE

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def cert(self) -> Path:
        return self.root / "cert.pem"

    @property
    def key(self) -> Path:
        return self.root / "key.pem"

    def relay_bundle(self, name: str) -> Path:
        return self.root / "relays" / name

    def exists(self) -> bool:
        return self.ca_key.exists() or self.settings.exists()


def split_host_port(text: str, *, default_port: int | None = None) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` for an IPv6 address) as ``(host, port)``."""
    parts = urlsplit(f"//{text}")
    try:
        port = parts.port
    except ValueError as exc:
        raise BadRequest(f"{text!r}: bad port ({exc})") from exc
    host = parts.hostname
    if not host or parts.path or parts.username or parts.password:
        raise BadRequest(f"{text!r} is not HOST:PORT")
    if port is None:
        if default_port is None:
            raise BadRequest(f"{text!r} has no port (HOST:PORT)")
        port = default_port
    if not 0 < port < 65536:
        raise BadRequest(f"{text!r}: port {port} is not between 1 and 65535")
    return host, port


def parse_public_url(url: str) -> tuple[str, int]:
    """The host and port of ``https://HOST[:PORT]`` (port 443 if none)."""
    parts = urlsplit(url)
    if parts.scheme != "https" or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise BadRequest(f"{url!r} is not https://HOST[:PORT]")
    return split_host_port(parts.netloc, default_port=443)


def _write_toml(path: Path, data: dict[str, Any]) -> None:
    write_private(path, tomli_w.dumps(data).encode())


def _server_cert(
    pool: PoolDir, host: str, cert: Path, key: Path, *, common_name: str, now: dt.datetime
) -> None:
    """A certificate naming ``host`` alone, from the pool CA."""
    dns, ips = pki.split_names([host])
    cert_pem, key_pem = pki.issue_server_cert(
        pool.ca_cert.read_bytes(),
        pool.ca_key.read_bytes(),
        common_name=common_name,
        dns_names=dns,
        ip_addresses=ips,
        now=now,
    )
    cert.write_bytes(cert_pem)
    write_private(key, key_pem)


def make_pool(
    pool: PoolDir,
    *,
    public_url: str,
    host: str,
    pool_name: str,
    state_dir: Path,
    now: dt.datetime,
    force: bool = False,
) -> dict[str, Any]:
    """Make the pool CA, the coordinator's certificate for the host of ``public_url`` and its
    settings; returns the settings written. An existing pool is replaced only with ``force``
    (its database is kept)."""
    url_host, port = parse_public_url(public_url)
    if pool.exists() and not force:
        raise Conflict(
            f"{pool.root} holds a pool already (init --force replaces its CA, certificates "
            "and settings: every relay and volunteer then needs the new ca.pem)",
            code="pool_exists",
        )
    for d in (pool.root, pool.root / "relays", state_dir):
        paths.private_dir(d)
    ca_cert, ca_key = pki.make_ca(pool_name, now=now)
    pool.ca_cert.write_bytes(ca_cert)
    write_private(pool.ca_key, ca_key)
    _server_cert(pool, url_host, pool.cert, pool.key, common_name="coordinator", now=now)
    settings = {
        "pool_name": pool_name,
        "public_url": public_url.rstrip("/"),
        "host": host,
        "port": port,
        "tls_cert": str(pool.cert),
        "tls_key": str(pool.key),
        "tls_ca": str(pool.ca_cert),
        "state_dir": str(state_dir),
    }
    _write_toml(pool.settings, settings)
    return settings


def renew_coordinator_cert(pool: PoolDir, public_url: str, *, now: dt.datetime) -> str:
    """A new certificate (and key) for the coordinator, for the host of ``public_url``, from
    the pool CA: an expiring one, or one made before the pool's certificates carried what
    strict verification needs (the Authority Key Identifier). The host named."""
    if not pool.ca_key.exists():
        raise NotFound(
            f"no pool CA key in {pool.root} (ca.key): renew the certificate where `init "
            "--public-url` made the pool",
            code="no_ca_key",
        )
    host, _ = parse_public_url(public_url)
    _server_cert(pool, host, pool.cert, pool.key, common_name="coordinator", now=now)
    return host


@dataclass(frozen=True)
class RelayBundle:
    dir: Path
    install_dir: Path
    host: str
    port: int


def check_relay_bundle(
    pool: PoolDir, settings_file: Path, public_url: str, bundle: Path, *, replace: bool
) -> None:
    """Refuse before anything is made: no pool CA, no public_url, or a bundle there already."""
    if not pool.ca_key.exists():
        raise NotFound(
            f"no pool CA next to {settings_file} ({pool.ca_key} is missing): --address needs "
            "the pool made by `vpool-coordinator init --public-url https://HOST:PORT`; give "
            f"that pool's {SETTINGS_FILE} as --config",
            code="no_pool",
        )
    if not public_url:
        raise BadRequest(
            f"{settings_file} sets no public_url: the relay would not know where the "
            'coordinator is (set public_url = "https://HOST:PORT")',
            code="no_pool",
        )
    if bundle.exists() and any(bundle.iterdir()) and not replace:
        raise Conflict(
            f"{bundle} exists already (--rotate makes a new key and replaces the bundle)",
            code="bundle_exists",
        )


def make_relay_bundle(
    pool: PoolDir,
    *,
    name: str,
    address: tuple[str, int],
    relay_key: str,
    coordinator_url: str,
    bundle: Path,
    install_dir: Path,
    now: dt.datetime,
) -> RelayBundle:
    """Write relay ``name``'s bundle: a certificate for its address signed by the pool CA,
    the CA and settings that ``vpool-relay --config INSTALL_DIR/relay.toml`` starts from once
    the directory is copied to ``install_dir`` on the relay machine."""
    host, port = address
    paths.private_dir(bundle)
    _server_cert(pool, host, bundle / "cert.pem", bundle / "key.pem", common_name=name, now=now)
    (bundle / "ca.pem").write_bytes(pool.ca_cert.read_bytes())
    _write_toml(
        bundle / RELAY_SETTINGS_FILE,
        {
            "name": name,
            "host": "0.0.0.0",
            "port": port,
            "advertise_host": host,
            "coordinator_url": coordinator_url.rstrip("/"),
            "coordinator_ca": str(install_dir / "ca.pem"),
            "relay_key": relay_key,
            "tls_cert": str(install_dir / "cert.pem"),
            "tls_key": str(install_dir / "key.pem"),
            "data_dir": str(install_dir / "data"),
            # A relay machine that loses power must not lose a message it acknowledged:
            # the log reaches the disk before the acknowledgement (docs/operating.md).
            "fsync": True,
        },
    )
    return RelayBundle(dir=bundle, install_dir=install_dir, host=host, port=port)
