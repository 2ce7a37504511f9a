"""``mpi4py.futures`` and ``mpi4py.util.pool``/``sync`` in vpool's mpi4py shim: task farms run as
real rank processes through ``vpool.sdk.mpiexec`` (``programs/futures_farm.py``), workers that
SIGKILL themselves (``programs/futures_lost.py``: re-dispatch, retries, all workers lost,
elastic growth), and, in process, the shim's modules against mpi4py 4.1.2's (the installed one,
read as source: importing it would start its MPI library here)."""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import trio

import vpool.mpi

PROGRAMS = Path(__file__).resolve().parent / "programs"
SHIM = vpool.mpi.SHIM_DIR / "mpi4py"

# Vendored modules with vpool's changes (listed in their headers); the others are upstream's
# code byte for byte after the header.
CHANGED = {"futures/__init__.py", "futures/_core.py", "futures/pool.py"}
# Names the shim adds to a module's ``__all__`` (vpool's additions, documented in its header).
ADDED = {"futures": ["WorkerLost"]}
VENDORED = [
    "futures/__init__.py",
    "futures/__main__.py",
    "futures/_base.py",
    "futures/_core.py",
    "futures/aplus.py",
    "futures/pool.py",
    "futures/server.py",
    "futures/util.py",
    "util/pool.py",
    "util/sync.py",
]
HEADER_LINES = 2  # mpi4py's Author and Contact lines, kept before vpool's


async def mpiexec(
    n: int, *argv: str, opts: tuple[str, ...] = (), env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    cmd = [sys.executable, "-m", "vpool.sdk.mpiexec", "-n", str(n), *opts, "--", *argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VPOOL_")} | (env or {})
    with trio.fail_after(120):
        return await trio.run_process(
            cmd,
            stdin=subprocess.DEVNULL,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=env,
            cwd=PROGRAMS,
        )


def farm_output(n: int, spawned: int = 0) -> str:
    workers = spawned or max(n - 1, 1)
    # One rank and no spawned workers: the tasks run in a thread.
    cause = "RemoteTraceback" if n > 1 or spawned else "NoneType"
    return (
        f"map {[x * x for x in range(12)]}\n"
        f"chunks {sum(x * x for x in range(100))}\n"
        f"unordered {[x * x for x in range(10)]}\n"
        f"as_completed {[2**i for i in range(16)]}\n"
        "wait True\n"
        "ranks True\n"
        f"workers {workers} {workers}\n"
        f"error ValueError bad 3 {cause}\n"
        "then 42\n"
    )


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.large
async def test_mpicommexecutor_farm(n: int) -> None:
    res = await mpiexec(n, "futures_farm.py", "comm")
    out, err = res.stdout.decode(), res.stderr.decode()
    assert res.returncode == 0, f"exit {res.returncode}\n{out}\n{err}"
    assert out == farm_output(n), err


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.large
async def test_shared_pool_farm(n: int) -> None:
    res = await mpiexec(n, "-m", "mpi4py.futures", "futures_farm.py", "pool")
    out, err = res.stdout.decode(), res.stderr.decode()
    assert res.returncode == 0, f"exit {res.returncode}\n{out}\n{err}"
    assert out == farm_output(n), err


@pytest.mark.large
async def test_spawned_pool_farm() -> None:
    res = await mpiexec(1, "futures_farm.py", "spawn")
    out, err = res.stdout.decode(), res.stderr.decode()
    assert res.returncode == 0, f"exit {res.returncode}\n{out}\n{err}"
    assert out == farm_output(1, spawned=3), err


# ---- lost workers (vpool's additions) ---------------------------------------------------------


async def lost(
    mode: str,
    tmp_path: Path,
    n: int = 1,
    opts: tuple[str, ...] = (),
    module: bool = False,
    env: dict[str, str] | None = None,
) -> tuple[str, str]:
    argv = ["-m", "mpi4py.futures"] if module else []
    res = await mpiexec(n, *argv, "futures_lost.py", mode, str(tmp_path), opts=opts, env=env)
    out, err = res.stdout.decode(), res.stderr.decode()
    assert res.returncode == 0, f"exit {res.returncode}\n{out}\n{err}"
    return out, err


@pytest.mark.large
async def test_a_lost_spawned_worker_has_its_task_redispatched(tmp_path: Path) -> None:
    out, err = await lost("once", tmp_path)
    assert out == "answer True\nredispatched 1 lost 1\n", err
    assert "mpi4py.futures: 1 tasks re-dispatched after 1 workers were lost\n" in err


@pytest.mark.parametrize("retries", [None, 1])
@pytest.mark.large
async def test_a_task_that_kills_every_worker_gets_worker_lost(
    tmp_path: Path, retries: int | None
) -> None:
    env = None if retries is None else {"MPI4PY_FUTURES_RETRIES": str(retries)}
    out, err = await lost("always", tmp_path, env=env)
    squares = "".join(f"{x} {x * x}\n" for x in range(8) if x != 3)
    lines = out.splitlines(keepends=True)
    # By default 3 retries: four workers lost with task 3 (re-dispatched three times), then its
    # future fails naming the last one.
    n = 3 if retries is None else retries
    assert "".join(line for line in lines if not line.startswith(("3 ", "names"))) == (
        squares + f"redispatched {n} lost {n + 1}\n"
    ), err
    assert f"3 WorkerLost True {n + 1}\n" in lines and "names True\n" in lines, out


@pytest.mark.large
async def test_the_spawned_pool_grows_back_after_a_loss(tmp_path: Path) -> None:
    # --universe 3: one rank, so at most two workers.
    out, err = await lost("grow", tmp_path, opts=("--universe", "3"))
    assert out == "workers 2 2 lost 1\n", err


@pytest.mark.large
async def test_mpicommexecutor_in_a_ulfm_job_redispatches(tmp_path: Path) -> None:
    out, err = await lost("comm", tmp_path, n=4, opts=("--on-failure", "ulfm"))
    assert out == "answer True\nredispatched 1 lost 1\n", err


@pytest.mark.large
async def test_the_shared_pool_in_a_ulfm_job_redispatches(tmp_path: Path) -> None:
    out, err = await lost("once", tmp_path, n=4, opts=("--on-failure", "ulfm"), module=True)
    assert out == "answer True\nredispatched 1 lost 1\n", err


@pytest.mark.large
async def test_all_workers_lost_breaks_the_executor(tmp_path: Path) -> None:
    out, err = await lost("all", tmp_path, n=3, opts=("--on-failure", "ulfm"))
    assert out == (
        "kinds ['BrokenExecutor']\n"
        "broken all 2 workers of the pool were lost and no other can be had\n"
    ), err


# ---- in process ---------------------------------------------------------------------------


def upstream_dir() -> Path:
    """The installed mpi4py's directory, found without importing it."""
    others = [p for p in sys.path if Path(p or ".").resolve() != SHIM.parent]
    spec = importlib.machinery.PathFinder.find_spec("mpi4py", others)
    if spec is None or spec.origin is None:
        pytest.skip("mpi4py is not installed")
    path = Path(spec.origin).parent
    if not (path.parent / "mpi4py-4.1.2.dist-info").is_dir():
        pytest.skip("the installed mpi4py is not 4.1.2")
    return path


def upstream_names(path: Path) -> tuple[list[str] | None, set[str]]:
    """A module's ``__all__`` (None without one) and the public names it defines."""
    names: set[str] = set()
    public = None
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    if target.id == "__all__":
                        public = list(ast.literal_eval(node.value))
                    names.add(target.id)
    return public, {n for n in names if not n.startswith("_")}


@pytest.fixture
def shim() -> Iterator[None]:
    """The shim's ``mpi4py`` importable here, and forgotten afterwards."""
    saved = {k: v for k, v in sys.modules.items() if k == "mpi4py" or k.startswith("mpi4py.")}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(SHIM.parent))
    try:
        yield
    finally:
        sys.path.remove(str(SHIM.parent))
        for k in [k for k in sys.modules if k == "mpi4py" or k.startswith("mpi4py.")]:
            del sys.modules[k]
        sys.modules.update(saved)


@pytest.mark.parametrize(
    "module", ["futures", "futures.aplus", "futures.util", "util.pool", "util.sync"]
)
def test_shim_exposes_mpi4py_names(shim: None, module: str) -> None:
    path = upstream_dir() / Path(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    public, defined = upstream_names(path)
    mod: ModuleType = importlib.import_module(f"mpi4py.{module}")
    assert Path(mod.__file__ or "").is_relative_to(SHIM)
    assert getattr(mod, "__all__", None) == (
        None if public is None else [*public, *ADDED.get(module, [])]
    )
    missing = [name for name in sorted({*(public or ()), *defined}) if not hasattr(mod, name)]
    assert not missing


def test_shim_keeps_util_pkl5_and_dtlib(shim: None) -> None:
    from mpi4py import MPI
    from mpi4py.util import dtlib, pkl5

    assert dtlib is sys.modules["vpool.mpi.npdtype"]
    assert issubclass(pkl5.Intracomm, MPI.Intracomm)
    assert pkl5.Request is MPI.Request


@pytest.mark.parametrize("rel", VENDORED)
def test_vendored_code_is_upstream_apart_from_listed_changes(rel: str) -> None:
    ours = (SHIM / rel).read_text().splitlines(keepends=True)
    theirs = (upstream_dir() / rel).read_text().splitlines(keepends=True)
    assert ours[:HEADER_LINES] == theirs[:HEADER_LINES]
    header = ours[HEADER_LINES:]
    assert header[0].startswith("# Copyright (c) 2026, Lisandro Dalcin. BSD-3-Clause")
    assert f"# Vendored from mpi4py 4.1.2 (src/mpi4py/{rel})" in header[1]
    if rel in CHANGED:
        assert not header[2].startswith("# vpool's changes: none.")
        assert "vpool" in "".join(ours)
    else:
        assert header[2] == "# vpool's changes: none.\n"
        assert ours[HEADER_LINES + 3 :] == theirs[HEADER_LINES:]
