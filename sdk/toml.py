"""Writing the flat TOML files vpool reads (client config, component configs).

Reading uses ``tomllib``; the standard library has no writer and the files are flat tables of
strings, numbers, booleans and lists of strings, so this small writer is enough.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | Path):
        return _string(str(value))
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def dumps(data: Mapping[str, Any]) -> str:
    """A flat TOML document; ``None`` values are left out."""
    return "".join(f"{key} = {_value(value)}\n" for key, value in data.items() if value is not None)


def write(path: Path, data: Mapping[str, Any], *, private: bool = False) -> None:
    """Write ``data`` to ``path`` atomically; ``private`` makes it readable by the owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(dumps(data))
    os.replace(tmp, path)
