"""Test sizes, each test marked with one: what it touches beyond the test's own memory.

- ``small``: no sockets and no process (files under ``tmp_path`` are fine);
- ``medium``: sockets and threads in the test's own process (a server on 127.0.0.1 or a unix
  socket, trio's networking, an in-process coordinator or relay);
- ``large``: it starts processes (``vsdk`` commands, ``vsdk mpiexec``, CRIU, bubblewrap, an
  in-process agent's ranks, a D-Bus daemon, real ``mpiexec``);
- ``pool``: a whole local pool (``tests/integration``), mpi4py's own suite under ``vsdk
  mpiexec`` (``tests/conformance``), or a browser against a pool (``tests/browser``).

A test's size is the largest of: its folder's (``FOLDER_SIZES``), that of every fixture it uses,
directly or through other fixtures (``FIXTURE_SIZES``), and a size it is marked with itself
(``pytestmark = pytest.mark.large`` in a module whose tests start processes in their bodies).
A mark smaller than what its fixtures make the test is an error at collection.

Select by size as by any mark: ``pytest -m small``, ``-m "small or medium"``, ``-m "not pool"``.
``pytest --quick`` (``quickmode.py``) runs the small and medium tests, and checks the sizes as
it goes: a small or medium test that starts a process (refused and skipped there), or a small
one that binds or connects a socket, is listed at the end and fails the run. Threads are not
checked (Python raises no audit event for a new thread).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

SIZES = ("small", "medium", "large", "pool")

DESCRIPTIONS = {
    "small": "no sockets and no process (sizes.py, given by fixture and folder)",
    "medium": "sockets and threads in the test's process (sizes.py)",
    "large": "starts processes (sizes.py)",
    "pool": "a whole local pool, mpi4py's suite, or a browser against a pool (sizes.py)",
}

FOLDER_SIZES = {"integration": "pool", "conformance": "pool", "browser": "pool"}

# The fixtures that make a test at least this size, as FILE::NAME (the file under tests/ that
# defines it: names repeat across folders). A fixture another one uses need not be here: the
# test's fixture closure holds both.
FIXTURE_SIZES: dict[str, str] = {
    # In-process servers on sockets: a relay and its fake agents, a TLS or silent port.
    "relay/conftest.py::relay": "medium",
    "relay/conftest.py::agents": "medium",
    "relay/conftest.py::pool": "medium",
    "test_reasons.py::closed_port": "medium",
    "test_reasons.py::other_ca": "medium",
    "test_reasons.py::silent_port": "medium",
    "test_reasons.py::tls_port": "medium",
    "test_logsetup.py::ok_url": "medium",
    "worker_agent/test_coordinator_failures.py::https_url": "medium",
    "worker_agent/test_checkpoints.py::store": "medium",
    # Processes: an agent runs its selftest and its ranks (bubblewrap, CRIU); a real relay or
    # coordinator of the agent's tests; a D-Bus daemon; cgroups and seccomp tried on children.
    "worker_agent/conftest.py::agent": "large",
    "worker_agent/conftest.py::coordinator": "large",
    "worker_agent/conftest.py::https_coordinator": "large",
    "worker_agent/conftest.py::relay": "large",
    "worker_agent/conftest.py::proxy": "large",
    "worker_agent/conftest.py::iso": "large",
    "worker_agent/conftest.py::rank_dir": "large",
    "worker_agent/fake_logind.py::dbus_daemon": "large",
    "worker_agent/test_agent_heartbeat.py::coordinator": "large",
    "worker_agent/test_cgroups.py::agent_group": "large",
    "worker_agent/test_cgroups.py::spawn": "large",
    "worker_agent/test_criu.py::processes": "large",
    "worker_agent/test_environments.py::envs": "large",
    "worker_agent/test_environments.py::index": "large",
    "worker_agent/test_privileged.py::evil": "large",
    "worker_agent/test_privileged.py::writable_root_sandbox": "large",
    "worker_agent/test_real_relay.py::coordinator": "large",
    "worker_agent/test_real_relay.py::real_relay": "large",
    "worker_agent/test_real_relay.py::relay_and_hub": "large",
    "worker_agent/test_relay_ft.py::settings": "large",
    "worker_agent/test_restore.py::coordinator": "large",
    "worker_agent/test_restore.py::settings": "large",
    "worker_agent/test_seccomp.py::runs": "large",
    "sdk/test_sdk_localpool.py::sleeper": "large",
}

TESTS = Path(__file__).parent


def _rank(size: str) -> int:
    return SIZES.index(size)


def fixtures_of(item: pytest.Item) -> list[str]:
    """Every fixture the test uses, directly or not, as ``FILE::NAME`` (the file under tests/
    that defines the one it gets: names repeat across folders)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    found = []
    for name in info.names_closure:
        defs = info.name2fixturedefs.get(name)
        if not defs:
            continue
        func = getattr(defs[-1], "func", None)
        code = getattr(func, "__code__", None)
        try:
            where = Path(code.co_filename).resolve().relative_to(TESTS) if code else None
        except ValueError:
            where = None  # a plugin's (tmp_path, monkeypatch, ...)
        if where is not None:
            found.append(f"{where.as_posix()}::{name}")
    return found


def size_of(item: pytest.Item) -> tuple[str, str]:
    """The test's size, and why (the folder, fixture or mark that makes it so)."""
    size, why = "small", "nothing larger"
    try:
        folder = item.path.relative_to(TESTS).parts[0]
    except ValueError:
        folder = ""
    if folder in FOLDER_SIZES:
        size, why = FOLDER_SIZES[folder], f"tests/{folder}"
    for fixture in fixtures_of(item):
        fixture_size = FIXTURE_SIZES.get(fixture)
        if fixture_size is not None and _rank(fixture_size) > _rank(size):
            size, why = fixture_size, f"fixture {fixture}"
    marked = [m.name for m in item.iter_markers() if m.name in SIZES]
    for mark in marked:
        if _rank(mark) < _rank(size):
            raise pytest.UsageError(
                f"{item.nodeid} is marked {mark}, but {why} makes it {size} (tests/sizes.py)"
            )
        if _rank(mark) > _rank(size):
            size, why = mark, "its mark"
    return size, why


def configure(config: pytest.Config, process_skip_reason: str) -> None:
    """The markers; under ``--quick`` (``quickmode.py``: ``process_skip_reason`` is what it says
    of a test it skipped for starting a process), the check."""
    for size in SIZES:
        config.addinivalue_line("markers", f"{size}: {DESCRIPTIONS[size]}")
    if config.getoption("quick") and not config.pluginmanager.has_plugin(PLUGIN_NAME):
        config.pluginmanager.register(SizeCheck(process_skip_reason), PLUGIN_NAME)


def collect(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test with its size (before ``-m`` selects); under ``--quick``, leave out the
    large and pool ones: they could only be skipped there, after their setup."""
    for item in items:
        size, why = size_of(item)
        if not any(m.name == size for m in item.iter_markers()):
            item.add_marker(getattr(pytest.mark, size))
        item.user_properties.append(("size", f"{size} ({why})"))
    if config.getoption("quick"):
        large = [i for i in items if i.get_closest_marker("large") or i.get_closest_marker("pool")]
        if large:
            config.hook.pytest_deselected(items=large)
            gone = set(large)
            items[:] = [i for i in items if i not in gone]


# ---- the check under --quick --------------------------------------------------------------

PLUGIN_NAME = "vpool-sizes"
_SOCKET_EVENTS = ("socket.bind", "socket.connect")


class SizeCheck:
    """Under ``--quick``: what each small or medium test did that its size does not allow.

    In the process that runs the tests, an audit hook notes the sockets a small test binds or
    connects (as a user property of its report); wherever the reports arrive (the controller
    under pytest-xdist), the reports say which tests were skipped for starting a process. At
    the end, the list, and the run fails."""

    def __init__(self, process_skip_reason: str) -> None:
        self.process_skip_reason = process_skip_reason
        self.current: pytest.Item | None = None
        self.seen: set[tuple[str, str]] = set()
        self.wrong: list[str] = []
        sys.addaudithook(self._audit)

    def _audit(self, event: str, args: tuple[Any, ...]) -> None:
        item = self.current
        if item is None or event not in _SOCKET_EVENTS:
            return
        if not any(m.name == "small" for m in item.iter_markers()):
            return
        self.current = None  # once per test (and no recursion from what follows)
        address = args[1] if len(args) > 1 else "?"
        item.user_properties.append(("size_violation", f"{event} {address!r}"))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Any:
        self.current = item
        try:
            return (yield)
        finally:
            self.current = None

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        size = next((s for s in ("small", "medium") if s in report.keywords), None)
        if size is None:
            return
        why = ""
        for name, value in report.user_properties:
            if name == "size_violation" and size == "small":
                why = f"opens a socket ({value})"
        if report.skipped and isinstance(report.longrepr, tuple):
            if report.longrepr[2] == self.process_skip_reason:
                why = "starts a process"  # the larger of the two
        if why and (report.nodeid, why) not in self.seen:
            self.seen.add((report.nodeid, why))
            self.wrong.append(f"{report.nodeid}: {size}, but {why}")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.wrong and not hasattr(session.config, "workerinput"):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.wrong:
            return
        terminalreporter.section("tests larger than their size (tests/sizes.py)", red=True)
        for line in sorted(self.wrong):
            terminalreporter.write_line(line)
        terminalreporter.write_line(
            "Mark them larger (pytestmark, or @pytest.mark.<size>), or give the fixture that "
            "does it a size in FIXTURE_SIZES."
        )
