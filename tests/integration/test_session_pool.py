"""The session pool the tests that do not break a pool share (``conftest.SessionPool``): its
hygiene check says when a test left it unfit for the next one, and only then is it started
anew."""

from __future__ import annotations

import json
import signal
import time

from tests.integration.conftest import REPO, SessionPool, alive, end_process

PACED = str(REPO / "tests" / "integration" / "programs" / "paced.py")


def test_the_session_pool_is_started_anew_only_when_a_test_broke_it(
    session_pool: SessionPool,
) -> None:
    pool = session_pool.get()
    assert session_pool.problem() is None, pool.logs()
    assert session_pool.get() is pool  # asked again: the same pool, not a new one

    # A job still running is a problem for the next test: it asserts on a quiet pool.
    res = pool.vsdk("submit", PACED, "--ranks", "2", "--json", "--", "600", "0.1")
    assert res.returncode == 0, res.stderr.decode()
    job = int(json.loads(res.stdout)["id"])
    pool.wait(job, lambda d: d["job"]["state"] == "running", "the job running")
    assert session_pool.problem() == f"job(s) {job} not ended"
    assert pool.vsdk("cancel", str(job)).returncode == 0
    pool.wait(job, lambda d: d["job"]["state"] == "cancelled", "the job cancelled")
    assert session_pool.problem() is None

    # A component gone is one too.
    victim = pool.pid_of("agent-2")
    end_process(victim, signal.SIGKILL)
    assert session_pool.problem() == "agent-2 gone"
    components = pool.pids()
    session_pool.close()
    again = session_pool.get()
    assert again.home != pool.home
    assert session_pool.problem() is None, again.logs()
    # The first pool is down: none of its processes is left.
    deadline = time.monotonic() + 30
    for p in components:
        while alive(p["pid"]):
            assert time.monotonic() < deadline, f"{p['name']} ({p['pid']}) still runs"
            time.sleep(0.05)
