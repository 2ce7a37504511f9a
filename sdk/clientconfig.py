"""The client config of ``vsdk``: which coordinator, which token, which CA.

A flat TOML file at ``vpool.paths.client_config_file()`` (``VPOOL_HOME`` moves it)::

    url = "https://127.0.0.1:8443"
    token = "..."
    ca = "/path/to/ca.pem"     # optional: trust only this CA; else the system's

Written by ``vsdk login`` and ``vsdk local up``, readable by its owner only (it holds a token).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from vpool import paths
from vpool.sdk import toml
from vpool.sdk.errors import ConfigError


@dataclass(frozen=True)
class ClientConfig:
    url: str
    token: str = ""
    ca: Path | None = None


def load(path: Path | None = None) -> ClientConfig:
    """Read the client config; ``ConfigError`` if it is missing or malformed."""
    path = path or paths.client_config_file()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(
            f"no client config at {path}: run `vsdk login URL --token T` or `vsdk local up`"
        ) from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read client config: {exc}") from exc
    unknown = set(data) - {"url", "token", "ca"}
    if unknown:
        raise ConfigError(f"{path}: unknown setting(s) {', '.join(sorted(unknown))}")
    url, token, ca = data.get("url"), data.get("token", ""), data.get("ca")
    if not isinstance(url, str) or not url:
        raise ConfigError(f"{path}: `url` must be a non-empty string")
    if not isinstance(token, str):
        raise ConfigError(f"{path}: `token` must be a string")
    if ca is not None and not isinstance(ca, str):
        raise ConfigError(f"{path}: `ca` must be a path")
    ca_path = None
    if ca:
        ca_path = Path(ca)
        if not ca_path.is_absolute():
            ca_path = path.parent / ca_path
    return ClientConfig(url=url.rstrip("/"), token=token, ca=ca_path)


def save(config: ClientConfig, path: Path | None = None) -> Path:
    """Write the client config (mode 0600) and return its path."""
    path = path or paths.client_config_file()
    toml.write(
        path,
        {
            "url": config.url,
            "token": config.token,
            "ca": str(config.ca.resolve()) if config.ca else None,
        },
        private=True,
    )
    return path
