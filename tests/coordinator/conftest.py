"""Fixtures of the coordinator tests. The helpers live in ``coord_helpers.py`` and
``ckpt_helpers.py`` next to this file; pytest runs with --import-mode=importlib, so they are
registered here by path before any test module imports them."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest


def _load_helpers(name: str) -> None:
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


_load_helpers("coord_helpers")
_load_helpers("ckpt_helpers")  # imports coord_helpers
from coord_helpers import Pool, open_pool  # noqa: E402


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[Pool]:
    async with open_pool(tmp_path) as pool:
        yield pool
