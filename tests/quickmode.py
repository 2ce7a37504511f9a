"""``pytest --quick``: every test that starts no process, and none that does.

Under ``--quick`` every way of starting a process (``subprocess`` and what goes through it:
``trio.run_process``, asyncio subprocesses, ``os.popen``; ``os.fork``, ``os.forkpty``,
``os.posix_spawn[p]``, ``os.system``; ``multiprocessing`` by any start method) raises
:class:`ProcessStartRefused`, a ``BaseException`` so that an ``except Exception`` in the code
under test does not swallow it. A test whose setup, call or teardown then ends in it is reported
as skipped, "starts a process: not run with --quick": whether the refusal reached pytest as
itself, in an exception group or in a ``__cause__``/``__context__`` chain, or showed some other
way while a start was refused in that phase (a thread that died, a wait for a server that never
came up). A module- or session-scoped fixture that starts a process so skips every test that
uses it. The tests sized large or pool (``sizes.py``) are not even tried; a small or medium one
skipped here fails the run at its end (``sizes.SizeCheck``): its size is wrong.

Code stopped halfway by a refusal leaves sockets and pipes open that no ``finally`` closes; so
as not to fail a later test with their ResourceWarnings, a skipped test's exception lets go of
its frames and its teardown is followed by a quiet garbage collection (see ``_release``).

Loaded by the root ``tests/conftest.py`` (by path: pytest runs with --import-mode=importlib, so
``tests`` is not on sys.path); ``tests/test_quickmode.py`` tests it.
"""

from __future__ import annotations

import _posixsubprocess
import gc
import os
import subprocess
import sys
import traceback
import warnings
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

OPTION = "--quick"
SKIP_REASON = "starts a process: not run with --quick"
PLUGIN_NAME = "vpool-quickmode"


class ProcessStartRefused(pytest.skip.Exception):  # type: ignore[misc,name-defined]
    """A test tried to start a process under ``pytest --quick``.

    A kind of ``pytest.skip``'s exception, so a ``BaseException`` that pytest knows: a fixture
    that raises it is remembered as skipped (the next test that asks for a module- or
    session-scoped one is skipped at once, the fixture is not set up again), and a test that
    raises it straight is skipped without help from :class:`QuickMode`."""


def _describe(what: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    if what == "subprocess.Popen":
        # Popen._execute_child(self, args, executable, ...)
        command = args[1] if len(args) > 1 else kwargs.get("args")
        return f"subprocess.Popen({command!r})"
    if what in ("os.posix_spawn", "os.posix_spawnp") and len(args) > 1:
        return f"{what}({args[0]!r}, {args[1]!r})"
    if what == "os.system" and args:
        return f"os.system({args[0]!r})"
    return f"{what}()"


# (module or class, attribute, what it is called in messages)
_TARGETS: list[tuple[Any, str, str]] = [
    # Both of Popen's ways (posix_spawn, and fork_exec, which subprocess imported as its own
    # name) go through _execute_child.
    (subprocess.Popen, "_execute_child", "subprocess.Popen"),
    # multiprocessing's spawn and forkserver start methods (and its resource tracker) call
    # _posixsubprocess.fork_exec itself; its fork method calls os.fork.
    (_posixsubprocess, "fork_exec", "_posixsubprocess.fork_exec"),
    (os, "fork", "os.fork"),
    (os, "forkpty", "os.forkpty"),
    (os, "posix_spawn", "os.posix_spawn"),
    (os, "posix_spawnp", "os.posix_spawnp"),
    (os, "system", "os.system"),
]


@contextmanager
def refuse_processes(on_refusal: Callable[[str], None] | None = None) -> Iterator[None]:
    """While inside, starting a process raises :class:`ProcessStartRefused` (after telling
    ``on_refusal`` what was refused). Nests: leaving restores what was there on entering."""
    saved: list[tuple[Any, str, Any]] = []

    def refuser(what: str) -> Callable[..., Any]:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            description = _describe(what, args, kwargs)
            if on_refusal is not None:
                on_refusal(description)
            raise ProcessStartRefused(f"{description}: tests start no process with {OPTION}")

        refuse.__name__ = refuse.__qualname__ = f"refused_{what.rsplit('.', 1)[-1]}"
        return refuse

    try:
        for owner, name, what in _TARGETS:
            if hasattr(owner, name):
                saved.append((owner, name, owner.__dict__[name]))
                setattr(owner, name, refuser(what))
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _exceptions(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and every exception it holds: in exception groups, as ``__cause__`` or
    ``__context__``, at any depth; each once."""
    stack = [exc]
    seen: set[int] = set()
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, BaseExceptionGroup):
            stack.extend(e.exceptions)
        stack.extend((e.__cause__, e.__context__))


def is_refusal(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a :class:`ProcessStartRefused` or holds one (in an exception group, as
    its ``__cause__`` or ``__context__``, at any depth)."""
    return any(isinstance(e, ProcessStartRefused) for e in _exceptions(exc))


@contextmanager
def _quietly() -> Iterator[None]:
    """No warning, and no "Exception ignored in" (pytest makes them errors of the next test)."""
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        sys.unraisablehook = hook


def _release(exc: BaseException | None) -> bool:
    """Let go of what the frames of a skipped test's exception hold; whether there was anything
    new to let go of. Code that was refused a process stops halfway, often with a socket or
    pipe open that only a ``finally`` it does not have would close; left to the garbage
    collector, that is a ResourceWarning, which fails whatever test is running then. A module-
    or session-scoped fixture keeps its exception (and so the frames) to raise it again for
    every test that asks for it: only the first time counts."""
    if exc is None or getattr(exc, "_quickmode_released", False):
        return False
    with _quietly():
        for e in _exceptions(exc):
            traceback.clear_frames(e.__traceback__)
        # pytest keeps the last failure of a test's call for post-mortem debugging.
        if is_refusal(getattr(sys, "last_value", None)):
            for name in ("last_type", "last_value", "last_traceback", "last_exc"):
                if hasattr(sys, name):
                    delattr(sys, name)
    exc._quickmode_released = True  # type: ignore[attr-defined]
    return True


def _collect() -> None:
    with _quietly():
        gc.collect()


# On a test skipped because it starts a process: its teardown is quiet; and whether to collect
# the garbage after it (not when all it did was meet a fixture's refusal, raised again).
_SKIPPED = pytest.StashKey[bool]()
_COLLECT = pytest.StashKey[bool]()


class QuickMode:
    """The plugin registered under ``--quick``."""

    def __init__(self) -> None:
        self.refusals: list[str] = []
        self._reported = 0  # refusals already attributed to a phase
        self.skipped = 0
        self.passed_anyway: list[str] = []

    def _refused(self, description: str) -> None:
        self.refusals.append(description)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtestloop(self, session: pytest.Session) -> Generator[None, object, object]:
        # The run of the tests, not their collection: a module may well ask at import whether
        # some program is installed. What is there before the first test (modules, the
        # collected tests) is frozen out of the garbage collector's way: collecting after a
        # skipped test then takes milliseconds, not a tenth of a second. A pytest run inside a
        # test (pytester) leaves the freezing to the outer one.
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.collect()
            gc.freeze()
        try:
            with refuse_processes(self._refused):
                return (yield)
        finally:
            if freeze:
                gc.unfreeze()

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, None, None]:
        # A test skipped here stopped halfway: its fixtures, torn down now, may hold sockets and
        # pipes that the code it never reached would have closed (see _release).
        if not item.stash.get(_SKIPPED, False):
            return (yield)
        with _quietly():
            try:
                return (yield)
            finally:
                if item.stash.get(_COLLECT, False):
                    gc.collect()

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
        report = yield
        # Refusals since the last report were made in this phase (setup, call or teardown).
        refused_here = self.refusals[self._reported :]
        self._reported = len(self.refusals)
        exc = call.excinfo.value if call.excinfo is not None else None
        refusal = is_refusal(exc)
        # Skipped already: a refusal that reached pytest as itself (it is a skip exception).
        # Failed: one that came wrapped (exception group, __cause__/__context__), or a refusal
        # in this phase that showed some other way (a thread that died, a server never up).
        if (report.skipped and refusal) or (report.failed and (refusal or refused_here)):
            report.outcome = "skipped"
            if hasattr(report, "wasxfail"):  # not an expected failure: a test not run
                del report.wasxfail
            # No line: -ra then folds the skips of a file into one line.
            report.longrepr = (str(item.path), None, SKIP_REASON)  # type: ignore[assignment]
            if call.when != "teardown":
                self.skipped += 1
            released = _release(exc)
            item.stash[_SKIPPED] = True
            item.stash[_COLLECT] = item.stash.get(_COLLECT, False) or released or bool(refused_here)
            if call.when == "teardown":
                _collect()
        elif refused_here and report.passed and call.when == "call":
            self.passed_anyway.append(f"{item.nodeid}: {refused_here[0]}")
        return report

    def pytest_report_header(self) -> str:
        return f"{OPTION}: a test that starts a process is skipped"

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        terminalreporter.write_line(
            f"{OPTION}: {self.skipped} test(s) skipped because they start a process"
        )
        if self.passed_anyway:
            terminalreporter.write_line(
                f"{OPTION}: {len(self.passed_anyway)} test(s) passed although a process start "
                "was refused (they may test less than in a full run):"
            )
            for line in self.passed_anyway:
                terminalreporter.write_line(f"  {line}")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        OPTION,
        action="store_true",
        default=False,
        help="run only the small and medium tests (tests/sizes.py), none of which may start a "
        "process: one that tries is skipped, and fails the run (the fast inner loop of "
        "`scripts/test --quick`)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("quick") and not config.pluginmanager.has_plugin(PLUGIN_NAME):
        config.pluginmanager.register(QuickMode(), PLUGIN_NAME)
