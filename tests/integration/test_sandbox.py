"""Hostile programs, run as jobs on a real local pool: every act is refused or contained.

Each probe is done from inside a rank (``programs/hostile.py``) and reports what happened; the
test asserts the specific outcome of each (an errno, a missing file, an empty process list),
never just that the job ran. Limits are set low on the pool's one agent (its config file,
then ``vsdk local restart``) so that a rank can reach them quickly.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.conftest import Pool, start_pool

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap (bwrap) is not installed"
)

PROGRAMS = Path(__file__).parent / "programs"
VSDK = str(Path(sys.executable).parent / "vsdk")
MEMORY = 256 * 1024**2
PROCESSES = 32
DISK = 64 * 1024**2


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    p = start_pool(tmp_path_factory.mktemp("sandbox"), agents=1, relays=1)
    try:
        config = p.home / "state" / "local-pool" / "agent-0" / "config.toml"
        with config.open("a") as f:
            f.write(f"rank_memory = {MEMORY}\nrank_processes = {PROCESSES}\n")
            f.write(f"rank_disk = {DISK}\n")
        # Stop the agent (a process this test started, by its pid) and start it on its new
        # settings.
        pid = p.pid_of("agent-0")
        pidfd = os.pidfd_open(pid)
        os.kill(pid, signal.SIGTERM)
        ready, _, _ = select.select([pidfd], [], [], 60)
        os.close(pidfd)
        assert ready, "agent-0 did not stop within 60 s"
        res = p.vsdk("local", "restart", "agent-0", timeout=120)
        assert res.returncode == 0, res.stderr.decode() + p.logs()
        yield p
    finally:
        p.vsdk("local", "down", timeout=120)


def run(
    pool: Pool, program: str, ranks: int, *args: str, timeout: float = 180, token: str = ""
) -> dict:
    user = Pool(pool.home, {**pool.env, "VSDK_TOKEN": token}) if token else pool
    res = user.vsdk(
        "submit",
        str(PROGRAMS / program),
        "--ranks",
        str(ranks),
        "--wait",
        "--",
        *args,
        timeout=timeout,
    )
    job = int(res.stderr.decode().split("job ", 1)[1].split()[0].rstrip(":,"))
    detail = user.vsdk("status", str(job), "--json")
    assert detail.returncode == 0, detail.stderr.decode()
    return {"res": res, "job": job, "detail": json.loads(detail.stdout)}


def agent_pid(pool: Pool) -> int:
    return pool.pid_of("agent-0")


def test_hostile_acts_are_refused(pool: Pool) -> None:
    identity = pool.home / "state" / "local-pool" / "agent-0" / "identity" / "identity.key"
    coordinator = json.loads((pool.home / "state" / "local-pool" / "pool.json").read_text())
    port = int(coordinator["url"].rsplit(":", 1)[1].split("/")[0])
    out = run(pool, "hostile.py", 2, str(identity), str(agent_pid(pool)), str(port))
    res = out["res"]
    assert res.returncode == 0, res.stderr.decode() + pool.logs()
    lines = [json.loads(line) for line in res.stdout.decode().splitlines()]
    assert len(lines) == 2, lines
    for seen in lines:
        # The volunteer's and the agent's files are not there at all.
        assert seen["identity"] == "FileNotFoundError", seen
        assert seen["shadow"] == "FileNotFoundError", seen
        assert seen["pool_home"] == "FileNotFoundError", seen
        # Only the sandbox's own processes: its init and the rank (and the probe's ps).
        assert seen["pids"] == [1, 2], seen
        assert seen["kill_agent"] == "ProcessLookupError", seen
        assert seen["secret_in_environ"] is False, seen
        assert seen["secret_file_left"] is False, seen
        # No network: nothing listens on the sandbox's own loopback, nothing else is there.
        assert seen["connect_coordinator"] in ("ECONNREFUSED", "ENETUNREACH"), seen
        assert seen["connect_outside"] == "ENETUNREACH", seen
        assert seen["write_usr"] == "EROFS", seen
        assert seen["write_work"] == "ok", seen
        assert seen["unshare_user"] == "EPERM", seen
        assert seen["ptrace"] == "EPERM", seen
        assert seen["mount"] == "EPERM", seen
        assert seen["netlink"] == "EAFNOSUPPORT", seen
        assert seen["caps"] == "0000000000000000", seen
        assert seen["no_new_privs"] == "1", seen
        assert seen["tmp_is_private"] is True, seen


def add_user(pool: Pool, name: str) -> str:
    """A second user of the pool, and its API token."""
    config = pool.home / "state" / "local-pool" / "coordinator" / "config.toml"
    coordinator = str(Path(sys.executable).parent / "vpool-coordinator")
    res = subprocess.run(
        [coordinator, "user", "add", name, "--config", str(config)],
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert res.returncode == 0, res.stderr.decode()
    return res.stdout.decode().strip()


def test_two_users_jobs_cannot_see_each_other(pool: Pool, tmp_path: Path) -> None:
    """A job of one user keeps a secret file and a process; a job of another user on the same
    agent looks for them by every path it could know."""
    bob = add_user(pool, "bob")
    first = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "vsdk"),
            "submit",
            str(PROGRAMS / "keeper.py"),
            "--ranks",
            "1",
            "--wait",
            "--",
            "60",
        ],
        env=pool.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        keeper_dir = None
        while keeper_dir is None and time.monotonic() < deadline:
            found = list(
                (pool.home / "state" / "local-pool" / "agent-0" / "work" / "ranks").glob(
                    "*/work/keeper-secret.txt"
                )
            )
            keeper_dir = found[0].parent if found else None
            if keeper_dir is None:
                time.sleep(0.1)
        assert keeper_dir is not None, "the keeper job never wrote its file"
        out = run(pool, "snoop.py", 1, str(keeper_dir / "keeper-secret.txt"), token=bob)
        assert out["res"].returncode == 0, out["res"].stderr.decode()
        assert out["detail"]["job"]["user"] == "bob"
        seen = json.loads(out["res"].stdout.decode())
        assert seen["by_host_path"] == "FileNotFoundError", seen
        assert seen["found_elsewhere"] == [], seen
        assert seen["other_processes"] == [], seen
    finally:
        first.kill()
        first.wait()


@pytest.mark.parametrize(
    ("what", "expected"),
    [
        ("memory", f"exceeded its memory limit of {MEMORY // 1024**2} MiB"),
        ("fork", f"hit its limit of {PROCESSES} processes"),
        ("bigfile", f"exceeded its disk limit of {DISK // 1024**2} MiB"),
        ("manyfiles", f"exceeded its disk limit of {DISK // 1024**2} MiB"),
    ],
)
def test_a_rank_past_its_limit_fails_the_job_with_the_limit_named(
    pool: Pool, what: str, expected: str
) -> None:
    # A rank of another job runs beside it on the same agent all along.
    bystander = subprocess.Popen(
        [VSDK, "submit", str(PROGRAMS / "bystander.py"), "--ranks", "1", "--wait"],
        env=pool.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    with bystander:
        try:
            _limit_beside(pool, bystander, what, expected)
        finally:
            if bystander.poll() is None:  # a failed assertion must not wait for it for ever
                bystander.kill()
    # The agent keeps running and the next job is served.
    ok = run(pool, "limits.py", 2, "nothing")
    assert ok["res"].returncode == 0, ok["res"].stderr.decode()


def _limit_beside(pool: Pool, bystander: subprocess.Popen[bytes], what: str, expected: str) -> None:
    """Rank 1 of a job goes past a limit while the bystander's rank runs on the same agent."""
    assert bystander.stdout is not None
    ready, _, _ = select.select([bystander.stdout], [], [], 120)
    assert ready and bystander.stdout.readline() == b"waiting\n"
    out = run(pool, "limits.py", 2, what)
    detail = out["detail"]
    assert detail["job"]["state"] == "failed", detail
    text = json.dumps(detail)
    assert f"rank 1 {expected}" in text, text[-3000:]
    # Counted as the program's error, not as a lost rank restarted again and again.
    assert all(r["incarnation"] == 1 for r in detail["ranks"]), detail["ranks"]
    # The other job's rank ran on untouched, and ends normally when told.
    assert bystander.poll() is None
    ranks = pool.home / "state" / "local-pool" / "agent-0" / "work" / "ranks"
    for rank_dir in ranks.iterdir():
        (rank_dir / "work" / "go").touch()
    rest, _ = bystander.communicate(timeout=60)
    assert (rest, bystander.returncode) == (b"done\n", 0)


def test_nothing_a_rank_started_survives_its_job(pool: Pool) -> None:
    out = run(pool, "limits.py", 2, "daemon")
    assert out["res"].returncode == 0, out["res"].stderr.decode()
    marker = f"vpool-daemon-{out['job']}".encode()
    # An agent reports a rank's exit only once its sandbox is gone (the init's death ends the
    # PID namespace and everything in it): the job's end comes after that.
    left = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker in f.read():
                    left.append(int(entry))
        except OSError:
            continue
    assert left == [], f"processes of job {out['job']} outlived it: {left}"
