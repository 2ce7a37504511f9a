"""A volunteer's install, end to end (issue 22): vpool built into a wheel, installed with only
the agent's dependencies (`pip install "vpool[agent]"`) into a fresh venv where the server
stack is absent, then that venv's `vpool-agent join URL TOKEN --ca CA` against a running local
pool, the agent started as the unit it wrote says, a job run on it, and `vpool-agent leave`
removing everything join wrote.

Where systemd runs (/run/systemd/system) with a user manager this test can reach, join starts
the unit itself and `systemctl --user is-active vpool-agent` is checked (unit-by-systemd);
elsewhere (a container) that case is skipped with the reason, and unit-run-by-hand runs the
unit's ExecStart command line itself, so what is tested is the unit's own command. About 40 s
with pip's cache warm (the wheel 3 s, the venv 8 s, the pool and the job the rest).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.integration.conftest import Pool, start_pool

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# What examples/pi.py prints on 2 ranks (its partial sums are math.fsum'd: no order effects).
PI_2 = b"pi is approximately 3.141592653590, error 8e-14\n(1000000 intervals over 2 ranks)\n"
SERVER_STACK = ("fastapi", "hypercorn", "sqlite_utils", "jinja2", "python_multipart")
# Not copied into the wheel's build tree: caches, virtualenvs, and what the wheel leaves out.
NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", ".cache", "build", "dist", "*.egg-info", "__pycache__", ".mypy_cache",
    ".ruff_cache", ".pytest_cache", ".hypothesis", "tests", "benchmarks", "docs",
)  # fmt: skip
JOB_DEADLINE = 120.0
STOP_DEADLINE = 30.0

pytestmark = pytest.mark.slow


def run(argv: list[str | Path], *, env: dict[str, str] | None = None, timeout: float = 300):
    res = subprocess.run(
        [str(a) for a in argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert res.returncode == 0, f"{shlex.join(map(str, argv))}:\n{res.stdout}\n{res.stderr}"
    return res


def agent_venv(tmp: Path, python: str = sys.executable) -> Path:
    """A fresh venv of ``python`` holding vpool[agent] from a wheel of this tree, and nothing
    else: the agent's dependencies at the versions ``requirements/agent.txt`` pins (what was
    tested; ``scripts/test --latest`` tries the newest), the wheel built by the test
    environment's own (locked) setuptools."""
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=NOT_SOURCE)
    build = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation"]
    run([*build, src, "-w", tmp / "wheels"])
    [wheel] = (tmp / "wheels").glob("vpool-*.whl")
    venv = tmp / "venv"
    run([python, "-m", "venv", venv])
    pip = [venv / "bin/python", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    run([*pip, "--require-hashes", "-r", REPO / "requirements/agent.txt"])
    run([*pip, "--no-deps", f"{wheel}[agent]"])
    return venv


NO_SYSTEMD = "systemd is not running here (no /run/systemd/system)"


def user_manager() -> str:
    """Why systemd's user manager cannot run the unit here, or "" if it can."""
    if not Path("/run/systemd/system").is_dir():
        return NO_SYSTEMD
    res = subprocess.run(
        ["systemctl", "--user", "is-system-running"], capture_output=True, text=True, check=False
    )
    if res.stdout.strip() not in ("running", "degraded"):
        return f"no systemd user manager to talk to ({res.stderr.strip() or res.stdout.strip()})"
    unit = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    if (unit / "systemd/user/vpool-agent.service").exists():
        return "this user has a vpool-agent unit of their own: not touching it"
    return ""


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def interpreter(version: str) -> str | None:
    """A Python ``version`` ("3.12") on this machine that runs (the tests' own for theirs):
    one pyenv built, or one on PATH (a pyenv shim without that version does not run)."""
    if version == f"{sys.version_info[0]}.{sys.version_info[1]}":
        return sys.executable
    built = sorted(Path.home().glob(f".pyenv/versions/{version}.*/bin/python{version}"))
    for candidate in [*map(str, reversed(built)), shutil.which(f"python{version}")]:
        if candidate is None:
            continue
        res = subprocess.run(
            [candidate, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            check=False,
        )
        if res.returncode == 0 and res.stdout.strip() == version:
            return candidate
    return None


# The desktops volunteers have: Debian 12 (3.11), Ubuntu 24.04 (3.12), Fedora 41 (3.13).
PYTHONS = ("3.11", "3.12", "3.13")


# The tests' own Python on every run; the others in the slow tier (the ``pythons`` marker:
# scripts/test runs them when what the install depends on changed, tests/conftest.py).
OWN = f"{sys.version_info[0]}.{sys.version_info[1]}"


@pytest.mark.parametrize(
    ("by_systemd", "version"),
    [pytest.param(False, v, marks=[] if v == OWN else [pytest.mark.pythons]) for v in PYTHONS]
    + [(True, "3.11")],
    ids=[f"unit-run-by-hand-py{v}" for v in PYTHONS] + ["unit-by-systemd"],
)
def test_agent_installs_alone_joins_runs_a_job_and_leaves(
    tmp_path: Path, by_systemd: bool, version: str
) -> None:
    """The unit's command run by hand where systemd does not run (it would start the unit
    for real: never with a home of the test's own), or the unit started by systemd's user
    manager where one can be reached: whichever this machine allows. The agent's venv is
    made by each Python the desktops it targets ship, where this machine has it (its ranks
    run with it too)."""
    python = interpreter(version)
    if python is None:
        pytest.skip(f"no Python {version} on this machine (python{version}, pyenv)")
    if by_systemd and (why := user_manager()):
        pytest.skip(f"systemctl --user is-active vpool-agent not checked: {why}")
    if not by_systemd and Path("/run/systemd/system").is_dir():
        pytest.skip("systemd runs here: join starts the unit, the unit-by-systemd case")
    venv = agent_venv(tmp_path, python)
    # The server stack is not there, and what needs it says what to install.
    probe = f"import importlib.util as u; print([m for m in {SERVER_STACK!r} if u.find_spec(m)])"
    assert run([venv / "bin/python", "-c", probe]).stdout.strip() == "[]"
    res = subprocess.run([venv / "bin/vpool-coordinator", "--help"], capture_output=True, text=True)
    assert res.returncode == 1 and 'pip install "vpool[server]"' in res.stderr

    pool = start_pool(tmp_path / "pool", agents=1, relays=1, extra=["--slots", "1"])
    agent: subprocess.Popen[bytes] | None = None
    log = tmp_path / "agent.log"
    # The volunteer's home: short, as homes are (its sockets' paths must fit in 108 bytes).
    home = Path(tempfile.mkdtemp(prefix="vpool-home-"))
    try:
        agent = _join_run_leave(pool, venv, home, log, by_systemd)
    finally:
        if agent is not None and agent.poll() is None:
            agent.kill()
            agent.wait()
        pool.vsdk("local", "down", timeout=60)
        shutil.rmtree(home, ignore_errors=True)


def _join_run_leave(
    pool: Pool, venv: Path, home: Path, log: Path, by_systemd: bool
) -> subprocess.Popen[bytes] | None:
    lay = pool.home / "state" / "local-pool"
    url = json.loads((lay / "pool.json").read_text())["url"]
    conf = lay / "coordinator" / "config.toml"
    coordinator = [BIN / "vpool-coordinator"]
    # Every rank goes to the volunteer's agent: the pool's own one is banned.
    run([*coordinator, "agent", "ban", "agent-0", "--reason", "test", "--config", conf])
    made = run([*coordinator, "join-token", "create", "--uses", "1", "--config", conf])
    token = made.stdout.strip()
    assert f"vpool-agent join https://HOST:PORT {token} --ca ca.pem" in made.stderr

    base = {
        "PATH": f"/usr/local/sbin:{os.environ['PATH']}",
        "LANG": "C.UTF-8",
        "PYTHONUNBUFFERED": "1",
    }
    if not by_systemd:
        # A volunteer's home of its own; the unit goes to its ~/.config/systemd/user.
        env = {
            **base,
            "HOME": str(home),
            "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_STATE_HOME": str(home / ".local/state"),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "XDG_DATA_HOME": str(home / ".local/share"),
        }
    else:
        # The user manager reads only the real user's units: the unit goes there, everything
        # else under VPOOL_HOME.
        env = {**os.environ, **base, "VPOOL_HOME": str(home)}
        env = {k: v for k, v in env.items() if not k.startswith("VPOOL_AGENT_")}
    before = tree(home)
    joined = run(
        [venv / "bin/vpool-agent", "join", url, token, "--ca", lay / "ca.pem", "--slots", "2",
         "--name", "volunteer", "--user"],
        env=env, timeout=60,
    )  # fmt: skip
    said = joined.stdout
    record = json.loads(next(home.rglob("agent-join.json")).read_text())
    agent_id = record["agent_id"]
    assert f"enrolled in {url} as {agent_id} (name volunteer, 2 slots)" in said
    assert holds_no_token(record, token)
    unit = Path(record["unit"])
    assert f"systemd user unit: {unit}" in said
    [exec_start] = [ln for ln in unit.read_text().splitlines() if ln.startswith("ExecStart=")]
    argv = shlex.split(exec_start.removeprefix("ExecStart=").replace("%%", "%").replace("$$", "$"))
    assert argv == [str(venv / "bin/vpool-agent"), "--config", record["settings"]]

    agent = None
    if not by_systemd:
        assert f"service: not started, {NO_SYSTEMD}" in said
        with open(log, "wb") as out:
            agent = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    else:
        assert "service: enabled and started" in said, said
        state = subprocess.run(
            ["systemctl", "--user", "is-active", "vpool-agent"], capture_output=True, text=True
        )
        assert state.stdout.strip() == "active", state

    job = _run_pi(pool, agent, log)
    detail = json.loads(pool.vsdk("status", str(job), "--json").stdout)
    assert {r["agent"] for r in detail["ranks"]} == {agent_id}

    if agent is not None:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(STOP_DEADLINE) == 0, agent_log(log)
    left = run([venv / "bin/vpool-agent", "leave", "--yes", "--user"], env=env, timeout=120)
    assert f"left {url}: {agent_id} (volunteer) runs here no more" in left.stdout, left.stdout
    for path in [*record["files"], record["work_dir"], record["unit"]]:
        assert not Path(path).exists(), f"{path} is still there:\n{left.stdout}"
    assert tree(home) == before, left.stdout
    if by_systemd:
        gone = subprocess.run(
            ["systemctl", "--user", "is-active", "vpool-agent"], capture_output=True, text=True
        )
        assert gone.stdout.strip() != "active"
    again = run([venv / "bin/vpool-agent", "leave", "--yes", "--user"], env=env)
    assert again.stdout.startswith("nothing to undo")
    return agent


def holds_no_token(record: dict[str, object], token: str) -> bool:
    """No file join wrote holds the join token (the identity key is the credential now)."""
    files = [Path(str(f)) for f in record["files"]]  # type: ignore[attr-defined]
    return all(token.encode() not in f.read_bytes() for f in files)


def agent_log(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-6000:]
    except FileNotFoundError:
        return "(the agent runs under systemd: journalctl --user -u vpool-agent)"


def _run_pi(pool: Pool, agent: subprocess.Popen[bytes] | None, log: Path) -> int:
    """Submit examples/pi.py on 2 ranks, wait for its output (watching that the agent lives)
    and check it; the job's id."""
    submit = subprocess.Popen(
        [BIN / "vsdk", "submit", REPO / "examples/pi.py", "--ranks", "2", "--wait"],
        env=pool.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + JOB_DEADLINE
    try:
        while submit.poll() is None:
            died = agent is not None and agent.poll() is not None
            if died or time.monotonic() > deadline:
                why = "the agent ended" if died else f"no end within {JOB_DEADLINE:g} s"
                raise AssertionError(f"{why}:\n{agent_log(log)}\n{pool.logs()}")
            try:
                submit.wait(0.5)
            except subprocess.TimeoutExpired:
                continue
        out, err = submit.communicate()
    finally:
        if submit.poll() is None:
            submit.kill()
            submit.communicate()
    assert submit.returncode == 0, f"{err.decode()}\n{agent_log(log)}\n{pool.logs()}"
    assert out == PI_2
    return int(next(w for w in err.decode().replace(":", " ").split() if w.isdigit()))
