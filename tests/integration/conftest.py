"""Real processes: a local pool started with `vsdk local up` in a private VPOOL_HOME."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
WAIT_RECHECK = 0.25  # s: the longest ``Pool.wait`` lets the coordinator hold a status call


@dataclass
class Pool:
    home: Path
    env: dict[str, str]

    def vsdk(self, *args: str, timeout: float = 180, stdin: bytes | None = None):
        # Without ``stdin`` vsdk reads nothing: no pipe this test inherited goes to a rank.
        return subprocess.run(
            [str(BIN / "vsdk"), *args],
            env=self.env,
            capture_output=True,
            timeout=timeout,
            input=stdin,
            stdin=subprocess.DEVNULL if stdin is None else None,
            check=False,
        )

    def status(self, job: int | None = None, wait: float = 0.0, seen: str = "") -> dict | None:
        """What ``vsdk status [JOB] --json`` prints, or None while the coordinator does not
        answer. Asked through the SDK's ``Client`` in this process: a wait that started a
        ``vsdk`` process every 50 ms took a core from the pool it waited for (the CLI itself
        is tested once, in test_local_pool.py). ``wait`` and ``seen``: a long-poll
        (``Client.status``)."""
        from vpool.sdk.client import Client
        from vpool.sdk.errors import VsdkError

        try:
            with Client.from_config(self.home / "config" / "client.toml", timeout=30) as client:
                if job is not None:
                    got: object = client.status(job, wait=wait, seen=seen)
                else:
                    got = {"pool": client.pool_info(), "agents": client.agents()}
        except (VsdkError, OSError):
            return None
        return json.loads(msgspec.json.encode(got))

    def detail(self, job: int | None = None) -> dict:
        """``status``, which must answer."""
        got = self.status(job)
        assert got is not None, f"the coordinator does not answer\n{self.logs()}"
        return got

    def wait(self, job: int, cond, what: str, timeout: float = 120) -> dict:
        """The job's status once ``cond(status)`` holds; fails after ``timeout`` s. Long-polls:
        the coordinator answers as soon as the job's detail changes, and at least every
        ``WAIT_RECHECK`` s (a ``cond`` may look at more than the detail: output, processes)."""
        deadline = time.monotonic() + timeout
        seen = ""
        while True:
            got = self.status(job, wait=WAIT_RECHECK, seen=seen)
            if got is not None and cond(got):
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not after {timeout} s; last {got}\n{self.logs()}")
            if got is None:
                time.sleep(0.05)  # the coordinator restarts
            else:
                seen = got["mark"]

    def pids(self) -> list[dict]:
        return json.loads((self.home / "state" / "local-pool" / "pids.json").read_text())

    def pid_of(self, prefix: str) -> int:
        return next(p["pid"] for p in self.pids() if p["name"].startswith(prefix))

    def rank_processes(self, agent_prefix: str = "agent") -> list[tuple[int, int, int]]:
        """(job, rank, pid as this test sees it) of every rank process under the pool's agents
        whose names start with ``agent_prefix``: ``python PROGRAM ...`` in its sandbox (not the
        sandbox's bwrap or init, whose command lines name the program too), and not a
        checkpoint clone (same command line and environment: its stdout is /dev/null, or its
        parent is the rank, which just forked it)."""
        found: dict[int, tuple[int, int, int]] = {}  # pid -> (job, rank, parent)
        for p in self.pids():
            if not p["name"].startswith(agent_prefix):
                continue
            todo = [p["pid"]]
            while todo and len(found) < 10_000:
                parent = todo.pop()
                for child in children(parent):
                    todo.append(child)
                    env, argv = environ_of(child), cmdline_of(child)
                    if b"VPOOL_RANK" not in env or len(argv) < 2 or not argv[1].endswith(b".py"):
                        continue
                    found[child] = (int(env[b"VPOOL_JOB"]), int(env[b"VPOOL_RANK"]), parent)
        return [
            (job, rank, pid)
            for pid, (job, rank, parent) in found.items()
            if parent not in found and stdout_of(pid) != "/dev/null"
        ]

    def rank_pid(
        self, rank: int, job: int, agent_prefix: str = "agent", timeout: float = 30
    ) -> int:
        """The pid of rank ``rank`` of ``job`` (``rank_processes``): exactly one. Waits up to
        ``timeout`` s for it: an agent reports a rank running once its sandbox started, which
        may be a moment before the sandbox's init has started the program (on a busy machine,
        more than a moment)."""
        deadline = time.monotonic() + timeout
        while True:
            pids = [p for j, r, p in self.rank_processes(agent_prefix) if (j, r) == (job, rank)]
            assert len(pids) <= 1, f"several processes for rank {rank} of job {job}: {pids}"
            if pids:
                return pids[0]
            assert time.monotonic() < deadline, f"no process for rank {rank} of job {job}"
            time.sleep(0.02)

    def rank_pids(self) -> dict[int, int]:
        """MPI rank -> pid of the rank processes of the newest job that runs."""
        found = self.rank_processes()
        newest = max((job for job, _, _ in found), default=None)
        return {rank: pid for job, rank, pid in found if job == newest}

    def logs(self) -> str:
        out = []
        for log in sorted((self.home / "state" / "local-pool" / "logs").glob("*.log")):
            out.append(f"----- {log.name}\n{log.read_text(errors='replace')[-4000:]}")
        return "\n".join(out)


def real_mpiexec(
    program: str,
    n: int,
    *args: str,
    cwd: Path = REPO,
    pythonpath: Path | None = None,
    stdin: Path | None = None,
) -> bytes:
    """The output of ``mpiexec -n N python PROGRAM ARGS`` with Debian's MPICH and the real
    mpi4py (the reference vpool's output must equal), run in ``cwd``; ``stdin`` goes to rank 0
    as ``vsdk submit --stdin`` sends it (none: an empty stdin, as a job without one gets)."""
    import shutil

    mpiexec = shutil.which("mpiexec")
    assert mpiexec, "scripts/test installs Debian's mpich: mpiexec is missing"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VPOOL")}
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    with open(stdin if stdin is not None else os.devnull, "rb") as given:
        res = subprocess.run(
            [mpiexec, "-n", str(n), sys.executable, program, *args],
            stdin=given,
            capture_output=True,
            timeout=180,
            env=env,
            check=False,
            cwd=cwd,
        )
    assert res.returncode == 0, res.stderr.decode()
    return res.stdout


_REFERENCES: dict[tuple[str, int, tuple[str, ...], Path | None], Future[bytes]] = {}
_REFERENCES_LOCK = threading.Lock()
_REFERENCE_RUNNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpiexec-reference")


def reference_soon(program: str, n: int, *args: str, stdin: Path | None = None) -> Future[bytes]:
    """``reference``'s output, made in a thread while the test goes on: for a program that
    mostly sleeps (tests/integration/programs/ckpt_stencil.py: 30 s of sleeps, a quarter of a
    core), whose run under ``mpiexec`` would otherwise hold the test up as long as the job
    under test takes. One at a time; ``stdin`` must stay where it is until it is done."""
    key = (program, n, args, stdin)
    with _REFERENCES_LOCK:
        made = _REFERENCES.get(key)
        if made is None:
            made = _REFERENCES[key] = _REFERENCE_RUNNER.submit(
                real_mpiexec, program, n, *args, stdin=stdin
            )
        return made


def reference(program: str, n: int, *args: str, stdin: Path | None = None) -> bytes:
    """What a fault-free run of PROGRAM prints, the output a job must match however it was
    hurt: ``real_mpiexec``'s (the product's promise: the same output as ``mpiexec``), once per
    test session for each program, rank count, arguments and stdin (it is deterministic: the
    pool's own fault-free runs printed the same, which ``test_local_pool`` checks too)."""
    return reference_soon(program, n, *args, stdin=stdin).result()


def end_process(pid: int, sig: int, timeout: float = 60) -> None:
    """Send ``sig`` to process ``pid`` and wait until it has exited (pinned by a pidfd: no
    stranger is signalled if the pid is reused); fails after ``timeout`` s."""
    exited = os.pidfd_open(pid)  # readable once the process has exited
    try:
        signal.pidfd_send_signal(exited, sig)
        ready, _, _ = select.select([exited], [], [], timeout)
        assert ready, f"process {pid} still runs {timeout} s after {signal.Signals(sig).name}"
    finally:
        os.close(exited)


def children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return found


def environ_of(pid: int) -> dict[bytes, bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return {}


def cmdline_of(pid: int) -> list[bytes]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def stdout_of(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return ""


def start_pool(
    tmp: Path,
    agents: int = 3,
    relays: int = 2,
    extra: list[str] | None = None,
    timers: str = "production",
) -> Pool:
    """``vsdk local up`` in ``tmp``: ``timers`` "test" for fault scenarios (a frozen agent
    replaced, a relay outage waited out in seconds); tests of the defaults keep production."""
    env = {**os.environ, "VPOOL_HOME": str(tmp)}
    pool = Pool(tmp, env)
    if SELFTEST_CACHE:
        extra = ["--selftest-cache", str(SELFTEST_CACHE[0]), *(extra or [])]
    res = pool.vsdk(
        "local",
        "up",
        "--agents",
        str(agents),
        "--relays",
        str(relays),
        "--timers",
        timers,
        *(extra or []),
        timeout=120,
    )
    if res.returncode != 0:
        raise AssertionError(
            f"local up failed: {res.stderr.decode()}\n{pool.logs() if tmp.exists() else ''}"
        )
    return pool


# The file every test pool's agents keep their sandbox selftest's findings in (`vsdk local up
# --selftest-cache`): the first agent of the session probes, the others reuse what it found
# while nothing it depends on changed (the agent checks). Its own tests probe anew.
SELFTEST_CACHE: list[Path] = []


@pytest.fixture(scope="session", autouse=True)
def _shared_selftest(tmp_path_factory: pytest.TempPathFactory) -> None:
    SELFTEST_CACHE[:] = [tmp_path_factory.getbasetemp() / "agent-selftest.json"]


class SessionPool:
    """The pool of a test session (of each xdist worker) for the tests that do not break it:
    started when a test first asks for it, checked after each test (``problem``) and started
    anew only when that test left it broken. Tests that kill or reconfigure parts of a pool
    have pools of their own (``fresh_pool``, ``pool4``, ``pool_1relay``, a module's own)."""

    AGENTS, RELAYS = 3, 2

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self._factory = factory
        self._pool: Pool | None = None

    def get(self) -> Pool:
        if self._pool is None:
            self._pool = start_pool(
                self._factory.mktemp("pool"), agents=self.AGENTS, relays=self.RELAYS
            )
        return self._pool

    def problem(self) -> str | None:
        """Why the pool is not as a test found it: a component's process gone, fewer live
        agents or relays than it started with (or more: a test's extra agent), or a job still
        queued or running. None when it is fine for the next test."""
        pool = self._pool
        if pool is None:
            return None
        from vpool.sdk.client import Client
        from vpool.sdk.errors import VsdkError

        gone = [p["name"] for p in pool.pids() if not alive(p["pid"])]
        if gone:
            return f"{', '.join(gone)} gone"
        try:
            with Client.from_config(pool.home / "config" / "client.toml", timeout=30) as client:
                info = client.pool_info()
                unfinished = client.jobs(state="running") + client.jobs(state="queued")
        except (VsdkError, OSError) as exc:
            return f"the coordinator does not answer: {exc}"
        if (info.agents, info.relays) != (self.AGENTS, self.RELAYS):
            return f"{info.agents} live agent(s) and {info.relays} relay(s)"
        if unfinished:
            return f"job(s) {', '.join(str(j.id) for j in unfinished)} not ended"
        return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.vsdk("local", "down", timeout=60)
            self._pool = None


def alive(pid: int) -> bool:
    """The process runs: it exists and is not a zombie (nor dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[-1][:1] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.fixture(scope="session")
def session_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SessionPool]:
    holder = SessionPool(tmp_path_factory)
    try:
        yield holder
    finally:
        holder.close()


@pytest.fixture
def pool(session_pool: SessionPool, request: pytest.FixtureRequest) -> Iterator[Pool]:
    """The session's pool (3 agents, 2 relays, production timers). A test on it submits its own
    jobs and asserts on them alone; if it leaves the pool broken (``SessionPool.problem``),
    the pool is stopped and the next test gets a new one (said in the test's properties and
    on stderr)."""
    yield session_pool.get()
    problem = session_pool.problem()
    if problem:
        request.node.user_properties.append(("session_pool_restarted", problem))
        print(f"the session pool is started anew after this test: {problem}", file=sys.stderr)
        session_pool.close()


@pytest.fixture
def fresh_pool(tmp_path: Path) -> Iterator[Pool]:
    p = start_pool(tmp_path / "home")
    try:
        yield p
    finally:
        p.vsdk("local", "down", timeout=60)


@pytest.fixture
def pool4(tmp_path: Path) -> Iterator[Pool]:
    """A fresh pool of 4 agents and 2 relays on the test timers (the fault-tolerance tests
    kill parts of it)."""
    p = start_pool(tmp_path / "home", agents=4, relays=2, timers="test")
    try:
        yield p
    finally:
        p.vsdk("local", "down", timeout=60)


@pytest.fixture
def pool_1relay(tmp_path: Path) -> Iterator[Pool]:
    """A fresh pool of 2 agents and a single relay (tests that change the relay's setup)."""
    p = start_pool(tmp_path / "home", agents=2, relays=1)
    try:
        yield p
    finally:
        p.vsdk("local", "down", timeout=60)
