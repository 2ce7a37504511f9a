"""``pytest --quick`` (``tests/quickmode.py``): under it no process starts, and a test that tries
is skipped. Nothing here starts a process, so all of it runs under ``--quick`` too: the guard is
exercised with the guard on, and the pytest runs inside these tests are in-process."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import subprocess
from collections.abc import Callable

import pytest
import quickmode  # registered by tests/conftest.py
import trio
from quickmode import ProcessStartRefused, is_refusal, refuse_processes


def _fork(fork: Callable[[], int]) -> None:
    # Should the guard let it through, the child must not go on running the tests.
    if fork() == 0:
        os._exit(0)


WAYS: dict[str, Callable[[], object]] = {
    "subprocess.run": lambda: subprocess.run(["true"], check=True),
    "subprocess.Popen": lambda: subprocess.Popen(["true"], stdout=subprocess.PIPE),
    "subprocess.check_output shell": lambda: subprocess.check_output("echo hi", shell=True),
    "os.popen": lambda: os.popen("true"),
    "os.system": lambda: os.system("true"),
    "os.fork": lambda: _fork(os.fork),
    "os.forkpty": lambda: _fork(lambda: os.forkpty()[0]),
    "os.posix_spawn": lambda: os.posix_spawn("/bin/true", ["true"], os.environ),
    "os.posix_spawnp": lambda: os.posix_spawnp("true", ["true"], os.environ),
    "os.spawnv": lambda: os.spawnv(os.P_WAIT, "/bin/true", ["true"]),
    # (the fork method is os.fork; it would leave its pipes open when refused)
    "multiprocessing spawn": lambda: multiprocessing.get_context("spawn").Process().start(),
    "multiprocessing forkserver": lambda: (
        multiprocessing.get_context("forkserver").Process().start()
    ),
    "asyncio": lambda: asyncio.run(asyncio.create_subprocess_exec("true")),
}


@pytest.mark.parametrize("start", WAYS.values(), ids=WAYS.keys())
def test_every_way_of_starting_a_process_is_refused(start: Callable[[], object]) -> None:
    refused: list[str] = []
    with refuse_processes(refused.append), pytest.raises(ProcessStartRefused, match="--quick"):
        start()
    assert len(refused) == 1


async def test_trio_run_process_is_refused() -> None:
    refused: list[str] = []
    with refuse_processes(refused.append), pytest.raises(BaseException) as info:
        await trio.run_process(["true"])
    assert is_refusal(info.value)
    assert refused == ["subprocess.Popen(['true'])"]


def _guarded() -> list[object]:
    return [getattr(owner, name) for owner, name, _ in quickmode._TARGETS]


def test_the_refusal_is_no_exception_and_leaving_puts_everything_back() -> None:
    before = _guarded()
    with refuse_processes():
        try:
            os.fork()
        except Exception:  # what product code catches does not stop it
            pytest.fail("caught as an Exception")
        except ProcessStartRefused:
            pass
        with refuse_processes():  # nested: leaving the inner one keeps the outer one
            pass
        with pytest.raises(ProcessStartRefused):
            subprocess.run(["true"])
    assert _guarded() == before


def _refusal() -> ProcessStartRefused:
    try:
        with refuse_processes():
            subprocess.run(["true"])
    except ProcessStartRefused as e:
        return e
    raise AssertionError("not refused")


def test_a_refusal_is_found_wherever_it_is_held() -> None:
    refusal = _refusal()
    assert is_refusal(refusal)
    assert is_refusal(
        BaseExceptionGroup("tasks", [ValueError(), BaseExceptionGroup("", [refusal])])
    )
    caused = RuntimeError("could not start the relay")
    caused.__cause__ = refusal
    assert is_refusal(caused)
    during = OSError("while handling it")
    during.__context__ = ExceptionGroup("", [caused])
    assert is_refusal(during)
    loop = ValueError()
    loop.__context__ = KeyError()
    loop.__context__.__context__ = loop
    assert not is_refusal(loop)
    assert not is_refusal(None)


TESTS = """
import os
import socket
import subprocess
import threading

import pytest

setups = []


@pytest.fixture(scope="module")
def server():
    setups.append(1)
    subprocess.run(["true"])
    yield


def test_plain():
    assert 1 + 1 == 2


def test_fails():
    assert 1 + 1 == 3


def test_starts():
    subprocess.run(["true"], check=True)


def test_catches_exception():
    try:
        subprocess.run(["true"])
    except Exception:
        pass


def test_in_a_group():
    try:
        os.fork()
    except BaseException as e:
        raise BaseExceptionGroup("tasks", [e])


def test_as_a_cause():
    try:
        os.posix_spawn("/bin/true", ["true"], os.environ)
    except BaseException as e:
        raise RuntimeError("could not start") from e


def test_in_a_thread():
    thread = threading.Thread(target=subprocess.run, args=(["true"],))
    thread.start()
    thread.join()
    raise AssertionError("the server never came up")


def test_uses_the_server(server):
    pass


def test_uses_the_server_too(server):
    pass


def test_the_server_was_tried_once():
    assert setups == [1]


def test_leaves_a_socket_open():
    sock = socket.socket()
    subprocess.run(["true"])
    sock.close()


def test_swallows_everything():
    try:
        subprocess.run(["true"])
    except BaseException:
        pass
"""


def test_quick_skips_the_tests_that_start_a_process(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_it=TESTS)
    # -W error: the socket left open must not fail the next test with its ResourceWarning.
    result = pytester.runpytest_inprocess("--quick", "-ra", "-W", "error", plugins=[quickmode])
    result.assert_outcomes(passed=3, failed=1, skipped=8)
    result.stdout.fnmatch_lines(
        [
            "--quick: a test that starts a process is skipped",
            "*--quick: 8 test(s) skipped because they start a process",
            "*--quick: 1 test(s) passed although a process start was refused*",
            "  test_it.py::test_swallows_everything: subprocess.Popen(['true'])",
            "SKIPPED [[]8[]] test_it.py: starts a process: not run with --quick",
            "FAILED test_it.py::test_fails - assert (1 + 1) == 3",
        ]
    )


def test_without_quick_nothing_changes(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        "def test_it(request):\n"
        "    assert not request.config.pluginmanager.has_plugin('vpool-quickmode')\n"
    )
    result = pytester.runpytest_inprocess(plugins=[quickmode])
    result.assert_outcomes(passed=1)
    assert "--quick" not in result.stdout.str()
