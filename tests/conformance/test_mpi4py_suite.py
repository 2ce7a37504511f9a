"""mpi4py 4.1.2's own test suite, core modules, at 1, 2 and 4 ranks under `vsdk mpiexec`: the
modules of test/ in one run per rank count, each judged on its own lines, the futures demos
apart (scripts/conformance.py, run_batch).

Runs through scripts/conformance.py (which fetches the sdist into .cache/sdist when missing). A
module passes when the suite ran tests and none failed, errored or hung on any rank. Modules that
do not pass yet are listed in KNOWN_FAILING with the reason; they are strict xfails, so the day
one starts passing this test fails until it is moved out of the list.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("conformance", REPO / "scripts" / "conformance.py")
assert _spec and _spec.loader
conformance = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conformance)

KNOWN_FAILING: dict[str, str] = {}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sdist() -> Path:
    return conformance.ensure_sdist()


CASES = [
    pytest.param(
        module,
        ranks,
        marks=[pytest.mark.xfail(reason=KNOWN_FAILING[module], strict=True)]
        if module in KNOWN_FAILING
        else [],
        id=f"{module}-{ranks}",
    )
    for module in conformance.CORE
    for ranks in (1, 2, 4)
]


# The core modules of one rank count, run together the first time one of them is asked for
# (conformance.run_batch: one start of the job instead of 22; each module keeps its verdict).
_BATCHES: dict[int, dict[str, dict]] = {}


def batch_result(sdist: Path, module: str, ranks: int) -> dict:
    if ranks not in _BATCHES:
        _BATCHES[ranks] = conformance.run_batch(sdist, conformance.CORE, ranks, timeout=300)
    return _BATCHES[ranks][module]


@pytest.mark.parametrize(("module", "ranks"), CASES)
def test_core_module(sdist: Path, module: str, ranks: int) -> None:
    result = batch_result(sdist, module, ranks)
    summary = {k: result[k] for k in ("tests", "passed", "failed", "errors", "skipped", "hung")}
    detail = (
        f"{module} at {ranks} ranks: {summary}; failed {result['failed_tests']}, "
        f"errors {result['error_tests']}\n{result['launcher']}"
    )
    assert result["tests"] > 0, detail
    assert result["failed"] == result["errors"] == result["hung"] == 0, detail
