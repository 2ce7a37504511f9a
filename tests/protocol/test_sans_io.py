"""protocol/ must stay sans-IO: no module in it imports an I/O library (trio's own layering test
does the same for trio: src/trio/_tests/test_exports.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import vpool.protocol

PROTOCOL_DIR = Path(vpool.protocol.__file__).parent
FORBIDDEN = {
    "trio",
    "anyio",
    "asyncio",
    "socket",
    "ssl",
    "selectors",
    "select",
    "subprocess",
    "sqlite3",
    "sqlite_utils",
    "httpx",
    "os",
    "pathlib",
    "shutil",
    "threading",
    "time",
    "io",
    "fastapi",
    "hypercorn",
    "tempfile",
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_protocol_modules_import_no_io() -> None:
    files = sorted(PROTOCOL_DIR.glob("*.py"))
    assert len(files) >= 6
    for path in files:
        for name in _imports(path):
            top = name.split(".")[0]
            assert top not in FORBIDDEN, f"{path.name} imports {name}"
            if top == "vpool":
                assert name.startswith("vpool.protocol"), f"{path.name} imports {name}"


@pytest.mark.large
def test_importing_protocol_loads_no_io_library() -> None:
    modules = [
        f"vpool.protocol.{p.stem}" for p in PROTOCOL_DIR.glob("*.py") if p.stem != "__init__"
    ]
    code = (
        "import sys\n"
        f"for m in {modules!r}: __import__(m)\n"
        "print(' '.join(sorted(m for m in ('trio', 'anyio', 'asyncio', 'sqlite3', 'subprocess', "
        "'httpx') if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
