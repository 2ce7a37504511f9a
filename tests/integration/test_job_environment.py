"""A job that needs a package the agents do not have (issue 18): it declares it, each agent
installs it once from the package index (one on disk here), the job prints what it would under
real MPI with the package installed, and a second job starts from the warm cache."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.integration.conftest import REPO, real_mpiexec, start_pool

if TYPE_CHECKING:
    from conftest import Pool

_spec = importlib.util.spec_from_file_location(
    "wheelhouse", REPO / "tests" / "helpers" / "wheelhouse.py"
)
assert _spec is not None and _spec.loader is not None
wheelhouse = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wheelhouse)

PACKAGE = {
    "vpooldemo/__init__.py": "__version__ = '1.0'\n\ndef weight(r):\n    return 10 * r + 1\n"
}


def _submit(project: Path) -> list[str]:
    """``vsdk submit`` of a project's main.py on 4 ranks with its requirements.txt."""
    return [
        "submit",
        str(project),
        "--entry",
        "main.py",
        "--ranks",
        "4",
        "--requirements",
        str(project / "requirements.txt"),
    ]


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
    """A program over modules and a data directory (tests/integration/programs/project), whose
    requirements.txt names a package the agents do not have."""
    pool, index = index_pool
    project = tmp_path / "project"
    shutil.copytree(REPO / "tests" / "integration" / "programs" / "project", project)
    main = (project / "main.py").read_text()
    (project / "main.py").write_text(
        main.replace("from mpi4py import MPI\n", "import vpooldemo\nfrom mpi4py import MPI\n", 1)
        + "if rank == 0:\n    print('vpooldemo', vpooldemo.__version__)\n"
    )
    (project / "requirements.txt").write_text("vpooldemo>=1.0\n")
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
    real = real_mpiexec("main.py", 4, cwd=project, pythonpath=site)

    times = []
    for _ in range(2):
        start = time.monotonic()
        res = pool.vsdk(*_submit(project), "--wait")
        times.append(time.monotonic() - start)
        assert res.returncode == 0, res.stderr.decode()
        assert res.stdout == real
        assert res.stdout.endswith(b"vpooldemo 1.0\n") and b"96 values over 4 ranks" in res.stdout
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


@pytest.mark.slow
def test_a_rank_in_an_environment_is_restored_on_another_agent(tmp_path: Path) -> None:
    """A job with requirements is checkpointed; its agent is killed; the rank is restored on
    another agent that built the same environment (its image's fingerprint says which)."""
    from tests.integration import test_checkpoints as ckpt

    index = wheelhouse.make_index(tmp_path / "index", {"vpooldemo": PACKAGE})
    pool = start_pool(tmp_path / "home", agents=3, relays=1, extra=["--package-index", index])
    try:
        project = tmp_path / "project"
        project.mkdir()
        stencil = Path(ckpt.PROGRAM).read_text()
        (project / "main.py").write_text("import vpooldemo  # noqa: F401\n" + stencil)
        (project / "requirements.txt").write_text("vpooldemo\n")

        def submit() -> int:
            res = pool.vsdk(
                *_submit(project),
                "--json",
                "--",
                "400",
            )
            assert res.returncode == 0, res.stderr.decode()
            return int(json.loads(res.stdout)["id"])

        first = submit()
        d = ckpt.wait_until(pool, first, ckpt.ended, "fault-free run")
        assert d["job"]["state"] == "succeeded", d
        reference = ckpt.output(pool, first)
        job = submit()
        ckpt.wait_until(
            pool, job, lambda d: ckpt.ended(d) or b"step 30:" in ckpt.output(pool, job), "progress"
        )
        ckpt.checkpoint_now(pool, job, 1)
        d = ckpt.wait_until(pool, job, ckpt.checkpoints_of(1, 1), "the checkpoint of rank 1")
        assert not ckpt.ended(d), d["events"]
        host = next(r["agent"] for r in d["ranks"] if r["rank"] == 1)
        victim = next(
            p["name"]
            for p in pool.pids()
            if p["name"].startswith("agent-") and ckpt.agent_id(pool, p["name"]) == host
        )
        os.kill(pool.pid_of(victim), signal.SIGKILL)
        d = ckpt.finish(pool, job, reference)
        restored = ckpt.events(d, "rank_restored", 1)
        assert restored, d["events"]
        assert next(r["agent"] for r in d["ranks"] if r["rank"] == 1) != host
    finally:
        pool.vsdk("local", "down", timeout=60)
