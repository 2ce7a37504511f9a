"""The whole pool as separate processes on 127.0.0.1: `vsdk local up`, then `vsdk submit`.

Each example's output through vpool equals real `mpiexec -n 8 python examples/X.py` (Debian's
MPICH with a real mpi4py built against it, installed by scripts/test), with the ranks spread over 3
agents and 2 relays. What happens when components die mid-job is in test_fault_tolerance.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.integration.conftest import real_mpiexec

if TYPE_CHECKING:
    from conftest import Pool

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

EXAMPLES = sorted(p.name for p in (REPO / "examples").glob("*.py"))


def mpiexec_output(program: str, n: int) -> bytes:
    return real_mpiexec(program, n)


def job_detail(pool: Pool, job: int) -> dict:
    res = pool.vsdk("status", str(job), "--json")
    assert res.returncode == 0, res.stderr.decode()
    return json.loads(res.stdout)


def submitted_job_id(stderr: bytes) -> int:
    for word in stderr.decode().replace(":", " ").split():
        if word.isdigit():
            return int(word)
    raise AssertionError(f"no job id in {stderr!r}")


def test_there_are_at_least_three_examples() -> None:
    assert len(EXAMPLES) >= 3


@pytest.mark.parametrize("example", EXAMPLES)
def test_example_output_matches_real_mpiexec(pool: Pool, example: str) -> None:
    program = str(REPO / "examples" / example)
    res = pool.vsdk("submit", program, "--ranks", "8", "--wait")
    assert res.returncode == 0, f"{res.stderr.decode()}\n{pool.logs()}"
    assert res.stdout == mpiexec_output(program, 8)
    detail = job_detail(pool, submitted_job_id(res.stderr))
    assert detail["job"]["state"] == "succeeded" and detail["job"]["exit_code"] == 0
    ranks = detail["ranks"]
    assert len(ranks) == 8
    assert len({r["agent"] for r in ranks}) == 3, ranks
    assert len({r["relay"] for r in ranks}) == 2, ranks


def test_ranks_import_vpool_runtime_not_the_installed_mpi4py(pool: Pool) -> None:
    import mpi4py  # the real one, installed in this environment by scripts/test

    assert "vpool" not in mpi4py.__file__
    res = pool.vsdk(
        "submit", str(REPO / "tests/integration/programs/whoami.py"), "--ranks", "3", "--wait"
    )
    assert res.returncode == 0, res.stderr.decode()
    lines = res.stdout.decode().splitlines()
    assert len(lines) == 3
    for line in lines:
        _rank, path, seed = line.split()
        assert "/mpi/shim/mpi4py/" in path, path
        assert seed == "0"


def test_nonzero_exit_fails_the_job_with_that_code(pool: Pool, tmp_path) -> None:
    prog = tmp_path / "fail.py"
    prog.write_text(
        "import sys\nfrom mpi4py import MPI\n"
        "MPI.COMM_WORLD.Barrier()\n"
        "if MPI.COMM_WORLD.rank == 2:\n    sys.exit(7)\n"
        "MPI.COMM_WORLD.recv(source=2)\n"  # would hang forever if the job were not ended
    )
    res = pool.vsdk("submit", str(prog), "--ranks", "4", "--wait", timeout=60)
    assert res.returncode == 7, res.stderr.decode()
    assert b"rank 2" in res.stderr


def _listening_tcp_inodes() -> set[str]:
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                if cols[3] == "0A":  # LISTEN
                    inodes.add(cols[9])
    return inodes


def _socket_inodes(pid: int) -> set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[8:-1])
    return found


def test_agents_make_only_outbound_connections(pool: Pool) -> None:
    listening = _listening_tcp_inodes()
    agents = [p["pid"] for p in pool.pids() if p["name"].startswith("agent")]
    assert len(agents) == 3
    for pid in agents:
        assert not (_socket_inodes(pid) & listening), f"agent {pid} listens on TCP"
    # The relays and the coordinator do listen: the check can see listeners.
    relay = pool.pid_of("relay")
    assert _socket_inodes(relay) & listening


def _autogroup(pid: int | str) -> str | None:
    """The scheduler autogroup of a process (None where the kernel has none)."""
    try:
        # Empty for the kernel's default group (a session that never called setsid).
        return (Path(f"/proc/{pid}/autogroup").read_text().split() or ["default"])[0]
    except OSError:
        return None


def test_the_pool_shares_one_scheduling_group_and_ranks_run_idle(pool: Pool, tmp_path) -> None:
    """Niceness only weighs threads against others of their autogroup, and a new session makes
    a new autogroup: the components stay in the session that started the pool, each in a
    process group of its own. A rank runs in its sandbox's session, as pid 2 under the
    sandbox's init, in the idle scheduling class (and, where cgroups can be had, in a cgroup
    of the lowest CPU weight): it takes only the CPU time nothing else wants."""
    prog = tmp_path / "groups.py"
    prog.write_text(
        "import os\nfrom mpi4py import MPI\n"
        "print(MPI.COMM_WORLD.rank, os.getpid(), os.getpgid(0), os.getsid(0), "
        "os.sched_getscheduler(0))\n"
    )
    res = pool.vsdk("submit", str(prog), "--ranks", "2", "--wait", timeout=60)
    assert res.returncode == 0, res.stderr.decode()
    session, group = os.getsid(0), _autogroup("self")
    components = pool.pids()
    assert len(components) >= 4
    for p in components:
        assert os.getpgid(p["pid"]) == p["pid"], p  # its own process group...
        assert os.getsid(p["pid"]) == session, p  # ... in the session that ran `local up`
        assert _autogroup(p["pid"]) == group, p
    ranks = [line.split() for line in res.stdout.decode().splitlines()]
    assert sorted(r[0] for r in ranks) == ["0", "1"]
    for _rank, pid, pgid, sid, policy in ranks:
        assert (pid, pgid, sid) == ("2", "1", "1")  # the sandbox's init leads its session
        assert int(policy) == os.SCHED_IDLE


def test_input_piped_to_submit_wait_goes_to_rank_0(pool: Pool, tmp_path) -> None:
    prog = tmp_path / "upper.py"
    prog.write_text(
        "import sys\nfrom mpi4py import MPI\n"
        "if MPI.COMM_WORLD.rank == 0:\n    print(sys.stdin.read().upper(), end='')\n"
    )
    res = pool.vsdk("submit", str(prog), "--ranks", "2", "--wait", stdin=b"as with mpiexec\n")
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout == b"AS WITH MPIEXEC\n"
    assert b"rank 0 gets the 16 bytes piped to vsdk" in res.stderr


def test_a_project_over_modules_and_data_matches_real_mpiexec(pool: Pool) -> None:
    project = REPO / "tests" / "integration" / "programs" / "project"
    real = real_mpiexec("main.py", 4, cwd=project)
    res = pool.vsdk("submit", str(project), "--entry", "main.py", "--ranks", "4", "--wait")
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout == real and res.stdout.startswith(b"96 values over 4 ranks")
