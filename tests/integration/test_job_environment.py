"""A job that needs a package the agents do not have (issue 18): it declares it, each agent
installs it once from the package index (one on disk here), the job prints what it would under
real MPI with the package installed, and a second job starts from the warm cache."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.integration.conftest import REPO, start_pool

if TYPE_CHECKING:
    from conftest import Pool

_spec = importlib.util.spec_from_file_location(
    "wheelhouse", REPO / "tests" / "helpers" / "wheelhouse.py"
)
assert _spec is not None and _spec.loader is not None
wheelhouse = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wheelhouse)

PROGRAM = """\
from mpi4py import MPI
import vpooldemo

comm = MPI.COMM_WORLD
total = comm.reduce(vpooldemo.weight(comm.Get_rank()), root=0)
if comm.Get_rank() == 0:
    print("vpooldemo", vpooldemo.__version__, "total", total)
"""
PACKAGE = {
    "vpooldemo/__init__.py": "__version__ = '1.0'\n\ndef weight(r):\n    return 10 * r + 1\n"
}


@pytest.fixture
def index_pool(tmp_path: Path) -> tuple[Pool, str]:
    index = wheelhouse.make_index(tmp_path / "index", {"vpooldemo": PACKAGE})
    pool = start_pool(tmp_path / "home", agents=2, relays=1, extra=["--package-index", index])
    try:
        yield pool, index
    finally:
        pool.vsdk("local", "down", timeout=60)


@pytest.mark.slow
def test_a_job_gets_the_package_it_needs(index_pool: tuple[Pool, str], tmp_path: Path) -> None:
    pool, index = index_pool
    project = tmp_path / "project"
    project.mkdir()
    (project / "main.py").write_text(PROGRAM)
    (project / "pyproject.toml").write_text(
        '[project]\nname = "demo"\nversion = "0"\ndependencies = ["vpooldemo>=1.0"]\n'
    )
    # Real MPI, with the package installed next to it.
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--target",
            str(site),
            "--index-url",
            index,
            "vpooldemo",
        ],
        env={**os.environ, "PIP_CONFIG_FILE": os.devnull},
        check=True,
        capture_output=True,
    )
    mpiexec = shutil.which("mpiexec")
    assert mpiexec
    env = {k: v for k, v in os.environ.items() if not k.startswith("VPOOL")}
    real = subprocess.run(
        [mpiexec, "-n", "4", sys.executable, "main.py"],
        env={**env, "PYTHONPATH": str(site)},
        cwd=project,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert real.returncode == 0, real.stderr.decode()

    times = []
    for _ in range(2):
        start = time.monotonic()
        res = pool.vsdk("submit", str(project), "--entry", "main.py", "--ranks", "4", "--wait")
        times.append(time.monotonic() - start)
        assert res.returncode == 0, res.stderr.decode()
        assert res.stdout == real.stdout == b"vpooldemo 1.0 total 64\n"
    print(f"job with a cold environment: {times[0]:.2f} s; warm: {times[1]:.2f} s")

    # A package the index does not have: the job fails once, saying which and where.
    (tmp_path / "req.txt").write_text("vpoolnosuchthing\n")
    bad = pool.vsdk(
        "submit",
        str(project / "main.py"),
        "--ranks",
        "2",
        "--requirements",
        str(tmp_path / "req.txt"),
        "--wait",
    )
    said = bad.stderr.decode()
    assert bad.returncode != 0 and "vpoolnosuchthing" in said and "on agent agent-" in said
    assert "restart" not in said
