"""Checkpoint chores at a lower priority than the ranks (``vpool.niceness``), with real threads
and a real process; the kernel's own niceness is read back, nothing is mocked."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from vpool.niceness import MAX_NICE, nice_command, run_niced


def _mine() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_run_niced_runs_in_a_nicer_thread_and_leaves_the_caller_alone() -> None:
    before = _mine()
    seen: list[tuple[int, int]] = []

    def work() -> str:
        seen.append((threading.get_native_id(), _mine()))
        return "done"

    assert run_niced(work, 5) == "done"
    (tid, nice) = seen[0]
    assert tid != threading.get_native_id()
    assert nice == min(before + 5, MAX_NICE)
    assert _mine() == before
    # Nicer than 19 there is not: the kernel's ceiling, no error.
    run_niced(work, 40)
    assert seen[1][1] == MAX_NICE


def test_run_niced_zero_is_the_callers_thread() -> None:
    assert run_niced(threading.get_native_id, 0) == threading.get_native_id()


def test_run_niced_raises_the_works_error() -> None:
    def fail() -> None:
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        run_niced(fail, 3)


@pytest.mark.large
def test_nice_command_really_lowers_the_child() -> None:
    probe = [sys.executable, "-c", "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"]
    assert nice_command(probe, 0) is probe
    plain = int(subprocess.run(probe, capture_output=True, check=True).stdout)
    niced = int(subprocess.run(nice_command(probe, 7), capture_output=True, check=True).stdout)
    assert niced == min(plain + 7, MAX_NICE)
