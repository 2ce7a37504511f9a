"""Writing the flat TOML files vpool reads (client config, component configs).

Reading uses ``tomllib``; writing uses ``tomli_w`` (the standard library has no writer); this
module adds the atomic, optionally private, file write.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tomli_w


def dumps(data: Mapping[str, Any]) -> str:
    """A flat TOML document; ``None`` values are left out, paths written as strings."""
    return tomli_w.dumps(
        {k: str(v) if isinstance(v, Path) else v for k, v in data.items() if v is not None}
    )


def write(path: Path, data: Mapping[str, Any], *, private: bool = False) -> None:
    """Write ``data`` to ``path`` atomically; ``private`` makes it readable by the owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(dumps(data))
    os.replace(tmp, path)
