"""Fixtures of the relay tests: a pool's keys and a relay running in the test's nursery.

The fakes live in ``relay_fakes.py`` (and the store client's in ``store_fakes.py``) next to
this file, loaded by path and registered as modules of those names (pytest runs with
--import-mode=importlib, so test folders are not on sys.path); test modules then ``from
relay_fakes import ...``.
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import trio


def _load(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


fakes = _load("relay_fakes")
_load("store_fakes")  # uses relay_fakes


@pytest.fixture(autouse=True)
def no_relay_bugs(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """The relay logs an unexpected exception on a connection instead of crashing; in tests
    that is a failure."""
    yield
    # Every phase's records: ``caplog.records`` at teardown holds the teardown's only.
    records = [r for when in ("setup", "call", "teardown") for r in caplog.get_records(when)]
    bugs = [r for r in records if r.name.startswith("vpool.relay") and r.levelno >= logging.ERROR]
    assert not bugs, "\n".join(r.getMessage() + "\n" + (r.exc_text or "") for r in bugs)


@pytest.fixture(scope="session")
def pool(tmp_path_factory: pytest.TempPathFactory) -> object:
    return fakes.Pool(tmp_path_factory.mktemp("pki"))


@pytest.fixture
async def relay(nursery: trio.Nursery, pool: object, tmp_path: Path, agents: object) -> object:
    """A relay in the test's nursery."""
    return await fakes.start_relay(
        nursery,
        pool.settings(tmp_path / "relay"),  # type: ignore[attr-defined]
        signing_key=pool.key.public_key(),  # type: ignore[attr-defined]
    )


@pytest.fixture
async def agents() -> object:
    """Closes every FakeAgent a test opened."""
    opened: list[object] = []
    fakes.FakeAgent.opened = opened
    yield opened
    for agent in opened:
        await agent.aclose()  # type: ignore[attr-defined]
