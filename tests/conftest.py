"""Shared pytest setup: hypothesis profiles (``ci`` runs more examples, derandomized), and
``--quick`` (``quickmode.py`` next to this file: only the tests that start no process)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, settings

# pytester runs a pytest inside the test's process: tests/test_quickmode.py uses it.
pytest_plugins = ["pytester"]

settings.register_profile("dev", max_examples=100, deadline=None)
# ci: derandomized, so that a run of CI is repeatable (a property failure found by a random
# search is kept as an explicit @example, fixed or marked, not left to chance).
settings.register_profile(
    "ci",
    max_examples=400,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def _load_quickmode() -> ModuleType:
    # By path and registered as ``quickmode``: pytest runs with --import-mode=importlib, so
    # tests/ is not on sys.path.
    if "quickmode" in sys.modules:
        return sys.modules["quickmode"]
    spec = importlib.util.spec_from_file_location(
        "quickmode", Path(__file__).with_name("quickmode.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["quickmode"] = module
    spec.loader.exec_module(module)
    return module


quickmode = _load_quickmode()


def pytest_addoption(parser: pytest.Parser) -> None:
    quickmode.pytest_addoption(parser)


def pytest_configure(config: pytest.Config) -> None:
    quickmode.pytest_configure(config)


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Where the run's time goes (scripts/test-times reads the JUnit XML scripts/test writes):
    # the fixtures each test uses, so time can be summed per pool fixture.
    params = getattr(getattr(item, "callspec", None), "params", {})
    names = [n for n in getattr(item, "fixturenames", ()) if n not in params]
    item.user_properties.append(("fixtures", " ".join(sorted(names))))


# Sizes: ``pool`` (by folder: a whole local pool, mpi4py's suite under `vsdk mpiexec`, or a
# browser against a pool; the pool fixtures are tests/integration's) and ``exclusive`` (given by
# hand: a test that needs the machine to itself). scripts/test runs the rest on two workers
# first, then these one at a time: a pool, or the suite's ranks, keep both cores busy by
# themselves (beside the suite on two workers, an agent's start-up probes took over 20 s).
POOL_FOLDERS = ("integration", "conformance", "browser")
TESTS = Path(__file__).parent


def in_pool_folder(item: pytest.Item) -> bool:
    try:
        return item.path.relative_to(TESTS).parts[0] in POOL_FOLDERS
    except ValueError:
        return False


# The slow tier: tests that run when asked for (-m MARKER), under scripts/test --all, or when
# scripts/test found the files they guard changed (it sets the variable); otherwise they are
# skipped, saying so. Marker: (variable, why it is in the slow tier).
SLOW_TIER = {
    "search": (
        "VPOOL_TEST_SEARCH",
        "a mutation search (slow tier): -m search, scripts/test --all, or a change to the files "
        "it guards runs it; its kept counterexample is checked on every run",
    ),
    "pythons": (
        "VPOOL_TEST_PYTHONS",
        "the agent's install on another Python than the tests' (slow tier): -m pythons, "
        "scripts/test --all, or a change to the files it guards runs it; the tests' own "
        "Python's install runs on every run",
    ),
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the markers added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if in_pool_folder(item):
            item.add_marker(pytest.mark.pool)
    asked = config.getoption("markexpr") or ""
    for marker, (variable, reason) in SLOW_TIER.items():
        if marker in asked or os.environ.get(variable):
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)
