"""A package index on disk for tests of job environments: pure-Python wheels made here, in
the layout pip reads (PEP 503 "simple" pages), reachable as a ``file://`` URL, no network.

    index = make_index(tmp_path, {"vpooldemo": {"vpooldemo/__init__.py": "X = 42\\n"}})
    pip install --index-url index ...
"""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path


def _record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def make_wheel(out: Path, name: str, version: str, files: dict[str, str | bytes]) -> Path:
    """A pure-Python wheel ``name``-``version`` holding ``files`` (path -> text or bytes)."""
    dist = f"{name}-{version}.dist-info"
    contents: dict[str, bytes] = {
        path: data.encode() if isinstance(data, str) else data for path, data in files.items()
    }
    contents[f"{dist}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    ).encode()
    contents[f"{dist}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: vpool-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = "".join(f"{p},{_record_hash(d)},{len(d)}\n" for p, d in contents.items())
    contents[f"{dist}/RECORD"] = (record + f"{dist}/RECORD,,\n").encode()
    path = out / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in contents.items():
            zf.writestr(member, data)
    return path


def make_index(
    root: Path, packages: dict[str, dict[str, str | bytes]], version: str = "1.0"
) -> str:
    """A simple index under ``root`` serving one wheel per package; its ``file://`` URL."""
    simple = root / "simple"
    for name, files in packages.items():
        page = simple / name
        page.mkdir(parents=True)
        wheel = make_wheel(page, name, version, files)
        (page / "index.html").write_text(
            f'<!DOCTYPE html><html><body><a href="{wheel.name}">{wheel.name}</a></body></html>\n'
        )
    (simple / "index.html").write_text(
        "<!DOCTYPE html><html><body>"
        + "".join(f'<a href="{n}/">{n}</a>' for n in packages)
        + "</body></html>\n"
    )
    return simple.as_uri()
