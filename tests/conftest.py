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


def _load(name: str) -> ModuleType:
    # By path and registered under its name: pytest runs with --import-mode=importlib, so
    # tests/ is not on sys.path.
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


quickmode = _load("quickmode")
sizes = _load("sizes")


def pytest_addoption(parser: pytest.Parser) -> None:
    quickmode.pytest_addoption(parser)
    parser.addoption(
        "--lanes",
        action="store_true",
        default=False,
        help="with -n 2: the modules in CPU_LANE (tests/conftest.py) one after another on one "
        "worker, first; every other module on the other, a module at a time (scripts/test)",
    )


def pytest_configure(config: pytest.Config) -> None:
    quickmode.pytest_configure(config)
    sizes.configure(config, quickmode.SKIP_REASON)


def pytest_runtest_setup(item: pytest.Item) -> None:
    # Where the run's time goes (scripts/test-times reads the JUnit XML scripts/test writes):
    # the fixtures each test uses, so time can be summed per pool fixture.
    params = getattr(getattr(item, "callspec", None), "params", {})
    # (Not the private autouse ones, "_name": every test of a folder has them.)
    names = [
        n for n in getattr(item, "fixturenames", ()) if n not in params and not n.startswith("_")
    ]
    item.user_properties.append(("fixtures", " ".join(sorted(names))))


# Sizes (small, medium, large, pool: tests/sizes.py) by folder, fixture and mark; ``exclusive``
# (given by hand: a test that needs the machine to itself). scripts/test runs all but the
# exclusive ones on two workers in two lanes (CPU_LANE, below), then the exclusive ones one at
# a time; --quick runs the small and medium ones.


# The CPU lane (`pytest -n 2 --lanes`, as scripts/test runs the suite): the modules whose pools
# keep both cores busy by themselves (real mpiexec references of 8 ranks on 2 cores, mpi4py's
# suite, CRIU dumps every 2 s) run one after another on one worker, and first: they are the
# longest work unit. Every other module (the tests that start no pool, and pools that mostly
# wait on timers and faults) runs on the other worker, a module at a time, so that two of these
# never share the machine. Measured by their time beside another pool against alone (run
# scripts/test-times on a run's JUnit XML): 1.6 to 2.4 times as long, where the others took
# 0.9 to 1.3 times. The lane is the longest path of the run, but the comparisons of the examples
# and of mpi4py's demos with real mpiexec (8 MPICH ranks spinning on 2 cores) stay in it: run
# beside the other tests they starved them (an agent's selftest took over 30 s, a fault scenario
# did not end in 120 s).
CPU_LANE = (
    "tests/conformance/test_mpi4py_suite.py",
    "tests/integration/test_checkpoints.py",
    "tests/integration/test_fault_tolerance.py",
    "tests/integration/test_local_pool.py",
    "tests/integration/test_failure_modes.py",
    "tests/integration/test_sdist_demos.py",
)


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    if not config.getoption("lanes"):
        return None
    from xdist.scheduler import LoadFileScheduling

    class Lanes(LoadFileScheduling):
        """loadfile, but the CPU lane's modules are one work unit."""

        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return "cpu-lane" if module in CPU_LANE else module

    config.option.loadscopereorder = False  # keep the order: the CPU lane first
    return Lanes(config, log)  # type: ignore[arg-type]


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
    sizes.collect(config, items)
    if config.getoption("lanes"):
        # The CPU lane first (a stable sort): its worker starts on it at once.
        items.sort(key=lambda item: _module(item.nodeid) not in CPU_LANE)
    asked = config.getoption("markexpr") or ""
    for marker, (variable, reason) in SLOW_TIER.items():
        if marker in asked or os.environ.get(variable):
            continue
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if marker in item.keywords:
                item.add_marker(skip)
