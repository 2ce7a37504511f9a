"""Commands that need the server stack say what to install when it is missing (a volunteer's
`pip install "vpool[agent]"` has none of it): tests/integration/test_agent_install.py runs
them in such an installation; here the stack is hidden from ``importlib``."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from vpool import serverstack
from vpool.sdk.cli import cli as vsdk

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> object:
        return None if name in ("sqlite_utils", "hypercorn") else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def test_the_modules_checked_are_the_server_extra() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    server = {req.split(">")[0].split("=")[0] for req in project["optional-dependencies"]["server"]}
    assert server == set(serverstack.MODULES.values())
    base = {req.split(">")[0].split("=")[0] for req in project["dependencies"]}
    assert not base & server
    assert project["scripts"]["vpool-coordinator"] == "vpool.serverstack:coordinator_main"


def test_installed_here() -> None:
    assert serverstack.missing() == []
    serverstack.require("anything")


@pytest.mark.usefixtures("no_stack")
def test_coordinator_says_what_to_install(capsys: pytest.CaptureFixture[str]) -> None:
    assert serverstack.missing() == ["hypercorn", "sqlite-utils"]
    with pytest.raises(SystemExit) as exited:
        serverstack.coordinator_main()
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("vpool-coordinator: vpool-coordinator needs vpool's server stack")
    assert 'hypercorn, sqlite-utils are not installed: pip install "vpool[server]"' in err


@pytest.mark.usefixtures("no_stack")
def test_vsdk_local_up_says_what_to_install(tmp_path: Path) -> None:
    res = CliRunner().invoke(vsdk, ["local", "up"], env={"VPOOL_HOME": str(tmp_path)})
    assert res.exit_code == 1
    assert "vsdk local up needs vpool's server stack" in res.output
    assert 'pip install "vpool[server]"' in res.output
    assert not (tmp_path / "state").exists()  # nothing started, nothing made
