"""Where vpool keeps things on this machine.

``VPOOL_HOME`` (used by tests and by several pools side by side) puts everything under one
directory; otherwise the platform's user directories are used (platformdirs).
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def _home() -> Path | None:
    home = os.environ.get("VPOOL_HOME")
    return Path(home) if home else None


def config_dir() -> Path:
    home = _home()
    return home / "config" if home else Path(platformdirs.user_config_dir("vpool"))


def state_dir() -> Path:
    home = _home()
    return home / "state" if home else Path(platformdirs.user_state_dir("vpool"))


def cache_dir() -> Path:
    home = _home()
    return home / "cache" if home else Path(platformdirs.user_cache_dir("vpool"))


def client_config_file() -> Path:
    """``vsdk``'s config: coordinator URL, API token, CA file."""
    return config_dir() / "client.toml"


def local_pool_dir() -> Path:
    """State of the pool started by ``vsdk local up``."""
    return state_dir() / "local-pool"
