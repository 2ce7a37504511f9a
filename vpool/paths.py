"""Where vpool keeps things on this machine.

``VPOOL_HOME`` (used by tests and by several pools side by side) puts everything under one
directory; otherwise the platform's user directories are used (platformdirs).
"""

from __future__ import annotations

import os
import stat
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


def private_dir(path: Path) -> Path:
    """``path`` as a directory only this user can enter: made with mode 0700 if missing, else
    checked to be a real directory of this user's that nobody else can write to (one made by
    somebody else first, in a shared place like /dev/shm, is refused, not used)."""
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise PermissionError(f"{path} is not a directory")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to this user")
    if st.st_mode & 0o022:
        raise PermissionError(f"{path} can be written by others (mode {st.st_mode & 0o777:o})")
    return path
