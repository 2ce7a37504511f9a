"""Test sizes (``tests/sizes.py``): given by fixture, folder and mark, selected with ``-m``, and
checked under ``--quick``. The pytest runs here are in-process (pytester), on test files of
their own whose fixtures the sizes table is pointed at."""

from __future__ import annotations

from pathlib import Path

import pytest
import quickmode  # registered by tests/conftest.py
import sizes  # registered by tests/conftest.py

CONFTEST = f"""
import socket
import subprocess

import pytest
import sys

sizes = sys.modules["sizes"]


def pytest_configure(config):
    sizes.configure(config, {quickmode.SKIP_REASON!r})


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    sizes.collect(config, items)


@pytest.fixture
def server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s


@pytest.fixture
def child():
    return subprocess.run(["true"], check=True)


@pytest.fixture
def uses_child(child):
    return child
"""

TESTS = """
import socket
import subprocess

import pytest


def test_plain():
    assert 1 + 1 == 2


def test_with_a_server(server):
    assert server.getsockname()[1] > 0


def test_through_another_fixture(uses_child):
    assert uses_child.returncode == 0


@pytest.mark.large
def test_marked_large():
    subprocess.run(["true"], check=True)
"""


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_it=TESTS)
    monkeypatch.setattr(sizes, "TESTS", Path(pytester.path))
    monkeypatch.setattr(
        sizes, "FIXTURE_SIZES", {"conftest.py::server": "medium", "conftest.py::child": "large"}
    )
    return pytester


@pytest.mark.large  # its runs start `true` (test_through_another_fixture, test_marked_large)
@pytest.mark.parametrize(
    ("select", "ran"),
    [
        ("small", ["test_plain"]),
        ("medium", ["test_with_a_server"]),
        ("large", ["test_through_another_fixture", "test_marked_large"]),
        ("small or medium", ["test_plain", "test_with_a_server"]),
    ],
)
def test_sizes_come_from_fixtures_direct_or_not_and_marks(
    suite: pytest.Pytester, select: str, ran: list[str]
) -> None:
    result = suite.runpytest_inprocess("-m", select, "-v", plugins=[quickmode])
    result.assert_outcomes(passed=len(ran))
    for name in ran:
        result.stdout.fnmatch_lines([f"*::{name} PASSED*"])


def test_a_mark_smaller_than_a_fixture_makes_is_an_error(suite: pytest.Pytester) -> None:
    suite.makepyfile(
        test_wrong="""
import pytest

@pytest.mark.small
def test_it(server):
    pass
"""
    )
    result = suite.runpytest_inprocess("test_wrong.py", plugins=[quickmode])
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_it is marked small, but fixture conftest.py::server*"])


@pytest.mark.medium  # the runs bind sockets (test_with_a_server, test_binds)
def test_quick_runs_small_and_medium_and_fails_on_a_test_larger_than_its_size(
    suite: pytest.Pytester,
) -> None:
    result = suite.runpytest_inprocess("--quick", "-v", plugins=[quickmode])
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()
    result.assert_outcomes(passed=2, deselected=2)  # the two large ones were not tried

    suite.makepyfile(
        test_liars="""
import socket
import subprocess


def test_starts(server):
    subprocess.run(["true"], check=True)


def test_binds():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
"""
    )
    result = suite.runpytest_inprocess("--quick", "test_liars.py", plugins=[quickmode])
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*tests larger than their size*",
            "test_liars.py::test_binds: small, but opens a socket (socket.bind*",
            "test_liars.py::test_starts: medium, but starts a process",
        ]
    )


def test_the_suites_own_sizes_are_marked(request: pytest.FixtureRequest) -> None:
    # This test's own: small (no folder, fixture or mark makes it larger).
    assert request.node.get_closest_marker("small") is not None
    assert ("size", "small (nothing larger)") in request.node.user_properties
