"""Fixtures of the SDK tests. Helper modules sit next to this file and are loaded by path
(pytest runs with --import-mode=importlib, so test folders are not on sys.path)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

HERE = Path(__file__).parent


def _load(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def run_ranks() -> Any:
    """``run_ranks(program, size, args=None) -> {rank: stdout}`` with thread ranks."""
    return _load("sdk_fakempi").run_ranks


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private VPOOL_HOME, with no VSDK_* variables leaking in."""
    monkeypatch.setenv("VPOOL_HOME", str(tmp_path / "home"))
    for var in ("VSDK_CONFIG", "VSDK_URL", "VSDK_TOKEN", "VSDK_CA"):
        monkeypatch.delenv(var, raising=False)
    yield tmp_path / "home"


@pytest.fixture
def coord(home: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An in-memory fake coordinator; ``vsdk`` commands and ``coord.client()`` talk to it."""
    fake = _load("sdk_fakecoord").FakeCoordinator()
    from vpool.sdk.cli_common import Settings

    monkeypatch.setattr(Settings, "client", lambda self: fake.client())
    return fake
