"""Fixtures of the portal tests: the coordinator tests' in-process pool (``coord_helpers``,
loaded by path as ``tests/coordinator/conftest.py`` does) and signed-in browser-like clients
(``portal_helpers``)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def _load(name: str, path: Path) -> None:
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


_load("coord_helpers", HERE.parent / "coordinator" / "coord_helpers.py")
_load("ckpt_helpers", HERE.parent / "coordinator" / "ckpt_helpers.py")
_load("portal_helpers", HERE / "portal_helpers.py")
from portal_helpers import Portal, open_portal  # noqa: E402


@pytest.fixture
async def portal(tmp_path: Path) -> AsyncIterator[Portal]:
    async with open_portal(tmp_path) as p:
        yield p
