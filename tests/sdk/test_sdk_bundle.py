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


def test_absolute_inputs_land_under_their_own_names(app: Path) -> None:
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


def test_a_directory_input_brings_its_files(app: Path) -> None:
    b = build(app, [app.parent / "data"])  # absolute: under its own name
    assert members(b.data)["data/in.csv"] == b"1,2\n"


def test_clashing_names(app: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "params.txt").write_text("")
    (other / "app.py").write_text("")
    with pytest.raises(BundleError, match="two input files"):
        build(app, [app.parent / "params.txt", other / "params.txt"])
    with pytest.raises(BundleError, match="program's name"):
        build(app, [other / "app.py"])


# -- projects (issue 18) ------------------------------------------------------------------------


def test_relative_inputs_keep_their_paths(app: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(app.parent)
    b = build(Path("app.py"), [Path("data/in.csv"), Path("./params.txt")])
    assert sorted(members(b.data)) == ["app.py", "data/in.csv", "params.txt"]
    # SRC:DEST puts a file where the program looks for it; ``..`` lands under its name.
    b = build(Path("app.py"), ["params.txt:config/run.cfg", Path("data/../data/in.csv")])
    assert sorted(members(b.data)) == ["app.py", "config/run.cfg", "data/in.csv"]
    (app.parent.parent / "outside.txt").write_text("o")
    b = build(Path("app.py"), [Path("../outside.txt")])
    assert "outside.txt" in members(b.data)
    for dest in ("../evil", "/etc/passwd", "a//b"):
        with pytest.raises(BundleError, match="not a relative path inside"):
            build(Path("app.py"), [f"params.txt:{dest}"])


def test_a_project_directory_keeps_its_layout(tmp_path: Path) -> None:
    proj = tmp_path / "proj"
    for rel, text in {
        "main.py": "import sim\n",
        "sim/__init__.py": "",
        "sim/core.py": "X = 1\n",
        "data/grid.csv": "1\n",
        "__pycache__/main.cpython-311.pyc": "junk",
        ".git/HEAD": "ref",
        "venv/pyvenv.cfg": "home = /usr",
        "venv/lib/x.py": "",
        "sim/__pycache__/core.cpython-311.pyc": "junk",
    }.items():
        (proj / rel).parent.mkdir(parents=True, exist_ok=True)
        (proj / rel).write_text(text)
    b = build(proj, entry="main.py")
    assert b.entry == "main.py"
    assert sorted(members(b.data)) == ["data/grid.csv", "main.py", "sim/__init__.py", "sim/core.py"]
    with pytest.raises(BundleError, match=r"no '__main__.py' \(top-level programs: main.py\)"):
        build(proj)


def test_local_modules_of_a_single_file_are_packed(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text("import numpy, helper\nfrom pkg.sub import f\nimport json\n")
    (tmp_path / "helper.py").write_text("import util\n")  # imports another local module
    (tmp_path / "util.py").write_text("")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub.py").write_text("def f(): pass\n")
    (tmp_path / "unused.py").write_text("")
    b = build(tmp_path / "app.py")
    assert sorted(members(b.data)) == [
        "app.py",
        "helper.py",
        "pkg/__init__.py",
        "pkg/sub.py",
        "util.py",
    ]
    assert b.added == ("helper.py", "pkg/", "util.py")


def test_size_limits_are_clear(app: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vpool import bundle

    monkeypatch.setattr(bundle, "MAX_FILES", 2)
    with pytest.raises(BundleError, match="the job has 3 files, more than 2"):
        build(app, [app.parent / "data", app.parent / "params.txt"])
    monkeypatch.setattr(bundle, "MAX_FILES", 100)
    monkeypatch.setattr(bundle, "MAX_BYTES", 10)
    with pytest.raises(BundleError, match="more than 10; leave out"):
        build(app, [app.parent / "params.txt"])
