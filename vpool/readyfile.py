"""The ``--ready-file`` every long-running vpool process writes once it serves.

Launchers (``vsdk local up``, tests) wait for the file instead of sleeping; it is written
atomically (temp file, then rename), so a reader sees all of it or nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_ready_file(path: Path, info: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info))
    os.replace(tmp, path)
