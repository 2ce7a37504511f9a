"""scripts/conformance.py's batches: the modules of mpi4py's test/ run together, one job per
rank count, and each module is still judged on its own lines (``split_modules``), as a run of
it alone would be; where a batch stopped (a crash, a hang), the modules after it run alone."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

_spec = importlib.util.spec_from_file_location(
    "conformance", Path(__file__).resolve().parents[1] / "scripts" / "conformance.py"
)
assert _spec and _spec.loader
conformance = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("conformance", conformance)
_spec.loader.exec_module(conformance)

BANNER = "[0@vm] Python 3.11.7 (/venv/bin/python)\n[0@vm] MPI 4.1 (vpool 0.1.0)\n"
SUMMARY = "-" * 70 + "\nRan {n} tests in 0.512s\n\n{verdict}\n"


def log(*lines: str, summary: str | None = None) -> str:
    return BANNER + "".join(f"{line}\n" for line in lines) + (summary or "")


A = [
    "testOne (test_a.TestA.testOne) ... ok",
    "testTwo (test_a.TestA.testTwo) ... skipped 'needs MPI-IO'",
    "testThree (test_a.TestA.testThree)\nA docstring that unittest prints ... ok",
]
B_OK = ["testFour (test_b.TestB.testFour) ... ok"]
B_FAIL = ["testFour (test_b.TestB.testFour) ... FAIL"]
FAILURE = (
    "\n" + "=" * 70 + "\nFAIL: testFour (test_b.TestB.testFour)\n" + "-" * 70 + "\n"
    "Traceback (most recent call last):\n  ...\nAssertionError: 1 != 2\n\n"
)
C = ["testFive (test_c.TestC.testFive) ... ok"]
MODULES = ["test_a", "test_b", "test_c"]


def judged(logs: list[str], hung: bool = False) -> tuple[dict[str, dict], str | None]:
    parts, stopped = conformance.split_modules(logs, MODULES)
    return {m: conformance.parse(p, hung and m == stopped) for m, p in parts.items()}, stopped


def counts(result: dict) -> tuple[int, int, int, int, int, int]:
    return tuple(result[k] for k in ("tests", "passed", "failed", "errors", "skipped", "hung"))


def test_each_module_of_a_whole_batch_is_judged_on_its_own_lines() -> None:
    ok = log(*A, *B_OK, *C, summary=SUMMARY.format(n=5, verdict="OK (skipped=1)"))
    failed = log(
        *A, *B_FAIL, *C, summary=FAILURE + SUMMARY.format(n=5, verdict="FAILED (failures=1)")
    )
    results, stopped = judged([ok, failed])
    assert stopped is None
    # tests, passed, failed, errors, skipped, hung
    assert counts(results["test_a"]) == (3, 2, 0, 0, 1, 0)
    assert counts(results["test_b"]) == (1, 0, 1, 0, 0, 0)
    assert results["test_b"]["failed_tests"] == ["test_b.TestB.testFour"]
    assert counts(results["test_c"]) == (1, 1, 0, 0, 0, 0)
    assert results["test_a"]["skip_reasons"] == {"needs MPI-IO": 1}


def test_a_crash_is_the_module_it_happened_in_and_what_follows_runs_alone() -> None:
    # Rank 1 died in test_b; rank 0 had gone on to test_c before the job ended.
    logs = [log(*A, *B_OK, *C), log(*A, "testFour (test_b.TestB.testFour) ... ")]
    results, stopped = judged(logs)
    assert stopped == "test_b"
    assert set(results) == {"test_a", "test_b"}  # test_c: not reached, run alone
    assert counts(results["test_a"]) == (3, 2, 0, 0, 1, 0)
    assert results["test_b"]["errors"] == 1 and results["test_b"]["crashed_ranks"] == [1]


def test_a_hang_is_the_module_it_happened_in() -> None:
    logs = [log(*A, "testFour (test_b.TestB.testFour) ... ")] * 2
    results, stopped = judged(logs, hung=True)
    assert stopped == "test_b"
    assert results["test_b"]["hung"] == 1 and results["test_a"]["hung"] == 0
    assert counts(results["test_a"]) == (3, 2, 0, 0, 1, 0)


def test_a_rank_that_wrote_nothing_stops_the_batch_at_its_first_module() -> None:
    ok = log(*A, *B_OK, *C, summary=SUMMARY.format(n=5, verdict="OK (skipped=1)"))
    results, stopped = judged([ok, ""])
    assert stopped == "test_a" and set(results) == {"test_a"}
    assert results["test_a"]["errors"] == 1


def test_run_batch_runs_alone_what_the_batch_did_not_reach_and_the_extra_programs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    launched: list[list[str]] = []
    alone: list[str] = []

    def launch(cwd: Path, program: list[str], ranks: int, timeout: float) -> dict[str, Any]:
        launched.append(program)
        logs = [log(*A, "testFour (test_b.TestB.testFour) ... ")] * ranks
        return {"logs": logs, "hung": True, "exit_code": -9, "out": "", "elapsed": 6.0}

    def run_module(sdist: Path, module: str, ranks: int, timeout: float) -> dict[str, Any]:
        alone.append(module)
        return {"module": module, "alone": True}

    monkeypatch.setattr(conformance, "_launch", launch)
    monkeypatch.setattr(conformance, "run_module", run_module)
    results = conformance.run_batch(Path("/sdist"), [*MODULES, "test_futures"], 2, timeout=300)
    assert [p[2:] for p in launched] == [MODULES]  # one job: main.py -v test_a test_b test_c
    assert alone == ["test_c", "test_futures"]
    assert results["test_b"]["hung"] == 1 and results["test_b"]["batch"] == 3
    assert results["test_a"]["tests"] == 3 and not results["test_a"]["hung"]
    assert results["test_c"] == {"module": "test_c", "alone": True}
