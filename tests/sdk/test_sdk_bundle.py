"""Bundles: what a job's zip holds."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest

from vpool.sdk.bundle import build
from vpool.sdk.errors import BundleError


def members(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


@pytest.fixture
def app(tmp_path: Path) -> Path:
    (tmp_path / "app.py").write_text("print('hi')\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "in.csv").write_text("1,2\n")
    (tmp_path / "params.txt").write_text("x=1\n")
    return tmp_path / "app.py"


def test_py_program_with_inputs_at_the_zip_root(app: Path) -> None:
    b = build(app, [app.parent / "data" / "in.csv", app.parent / "params.txt"])
    assert b.entry == "app.py"
    assert members(b.data) == {
        "app.py": b"print('hi')\n",
        "in.csv": b"1,2\n",
        "params.txt": b"x=1\n",
    }


def test_bundles_are_deterministic(app: Path) -> None:
    first = build(app, [app.parent / "params.txt"]).data
    app.touch()  # a new mtime must not change the bundle (same sha256, no re-upload)
    assert build(app, [app.parent / "params.txt"]).data == first


def test_zip_program_is_passed_through_with_main_entry(tmp_path: Path) -> None:
    z = tmp_path / "app.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("__main__.py", "import lib\n")
        zf.writestr("lib.py", "")
    b = build(z)
    assert b.data == z.read_bytes()
    assert b.entry == "__main__.py"


def test_zip_program_with_explicit_entry_and_inputs(tmp_path: Path) -> None:
    z = tmp_path / "app.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("run.py", "")
    (tmp_path / "in.txt").write_text("data")
    b = build(z, [tmp_path / "in.txt"], entry="run.py")
    assert b.entry == "run.py"
    assert members(b.data) == {"run.py": b"", "in.txt": b"data"}


def test_zip_without_its_entry_is_refused(tmp_path: Path) -> None:
    z = tmp_path / "app.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("run.py", "")
    with pytest.raises(BundleError, match=r"__main__\.py"):
        build(z)


def test_not_a_zip_is_refused(tmp_path: Path) -> None:
    z = tmp_path / "app.zip"
    z.write_bytes(b"not a zip")
    with pytest.raises(BundleError, match="not a valid zip"):
        build(z)


def test_missing_program(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match=r"program .*nope\.py does not exist"):
        build(tmp_path / "nope.py")


def test_missing_input(app: Path) -> None:
    with pytest.raises(BundleError, match=r"input file .*missing\.csv does not exist"):
        build(app, [app.parent / "missing.csv"])


def test_directory_input(app: Path) -> None:
    with pytest.raises(BundleError, match="is a directory"):
        build(app, [app.parent / "data"])


def test_clashing_names(app: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "params.txt").write_text("")
    (other / "app.py").write_text("")
    with pytest.raises(BundleError, match="two input files"):
        build(app, [app.parent / "params.txt", other / "params.txt"])
    with pytest.raises(BundleError, match="program's name"):
        build(app, [other / "app.py"])
