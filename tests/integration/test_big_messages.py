"""Large messages between two agents, sealed and not: the pool's output equals real mpiexec's.

programs/big_messages.py has ranks 0 and 1 exchange 1 KiB, 64 KiB, 1 MiB and 64 MiB messages
both ways, as numpy buffers (``Send``/``Recv``) and pickled objects (``send``/``recv``), and
prints a digest of each. The pool has 2 agents of 1 slot each and one relay, so the two ranks
run on different agents and every message crosses the relay: sealed by the sender's agent,
opened by the receiver's (``protocol/sealing.py``, ``worker_agent/relay_inbound.py``). The
sizes cover every way ``Sealer.open`` gets a frame: small ones (read within the connection's
buffer), those of ``framing.LARGE`` (64 KiB: exactly, as a numpy buffer, and a little more, as
a pickle) and more, read into a buffer of their own and opened into a new one, and those of
``sealing.IN_PLACE_MIN`` (4 MiB) and more, opened in place. A message that does not open is
an ``integrity_failure`` event and its rank is restarted (not counted in the job's
``restarts``) until the job fails ("failed the same way 3 times in a row"); one opened wrong
prints another digest.

The job runs with ``seal_messages`` on (the agents' default), then again after both agents were
restarted with it off; both outputs must be byte-identical to each other and to `mpiexec -n 2`.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.integration.conftest import end_process, real_mpiexec, start_pool
from tests.integration.test_checkpoints import ended, output, wait_agents, wait_until

if TYPE_CHECKING:
    from conftest import Pool

pytestmark = pytest.mark.slow

PROGRAM = str(Path(__file__).parent / "programs" / "big_messages.py")
AGENTS = ("agent-0", "agent-1")
OFF_WARNING = "seal_messages is off"  # what an agent logs at start with sealing off
# The events of a job whose ranks each ran once, start to end. Anything else is a fault: a
# rank lost, restarted or fenced, or a message that did not open (``integrity_failure``: its
# rank is restarted, but that restart is not counted in the job's ``restarts``).
CLEAN_EVENTS = {"queued", "running", "rank_running", "rank_exited", "succeeded"}


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[Pool]:
    """2 agents of 1 slot each, 1 relay: the 2 ranks of a job run on different agents."""
    p = start_pool(tmp_path / "home", agents=2, relays=1, extra=["--slots", "1"])
    try:
        yield p
    finally:
        p.vsdk("local", "down", timeout=60)


def agent_log(pool: Pool, name: str) -> str:
    return (pool.home / "state" / "local-pool" / "logs" / f"{name}.log").read_text()


def seal_off(pool: Pool) -> None:
    """Restart both agents with ``seal_messages = false`` in their config files.

    The agents are stopped (SIGTERM, as a volunteer quits), then the coordinator is stopped
    too and started again before the agents are: the coordinator does not notice that an
    agent went away in the middle of its lease long-poll (up to ``lease_wait``, 20 s), and a
    job submitted meanwhile may have a rank leased to that dead request, lost (``no longer
    runs it``) and restarted. Restarting the coordinator ends those requests; it keeps its
    database, and its port (`vsdk local up` pinned it in its config file)."""
    for name in AGENTS:
        config = pool.home / "state" / "local-pool" / name / "config.toml"
        kept = [ln for ln in config.read_text().splitlines() if not ln.startswith("seal_messages")]
        config.write_text("\n".join([*kept, "seal_messages = false", ""]))
        end_process(pool.pid_of(name), signal.SIGTERM, 60)
    end_process(pool.pid_of("coordinator"), signal.SIGTERM, 60)
    for name in ("coordinator", *AGENTS):
        res = pool.vsdk("local", "restart", name)
        assert res.returncode == 0, res.stderr.decode() + pool.logs()
    wait_agents(pool, len(AGENTS))


def run_job(pool: Pool) -> bytes:
    """Submit the program on 2 ranks; its output once it succeeded, each rank having run
    once, start to end, on an agent of its own."""
    res = pool.vsdk("submit", PROGRAM, "--ranks", "2", "--json")
    assert res.returncode == 0, res.stderr.decode()
    job = int(json.loads(res.stdout)["id"])
    d = wait_until(pool, job, ended, f"job {job} ends", timeout=300)
    said = json.dumps(d["events"], indent=1)
    assert d["job"]["state"] == "succeeded", f"{d['job']}\n{said}\n{pool.logs()}"
    assert d["job"]["exit_code"] == 0, d["job"]
    assert d["job"]["restarts"] == 0, said
    assert {e["kind"] for e in d["events"]} <= CLEAN_EVENTS, said
    ranks = d["ranks"]
    assert sorted(r["rank"] for r in ranks) == [0, 1], ranks
    assert all(r["incarnation"] == 1 and r["restored_from"] == -1 for r in ranks), ranks
    assert all(r["state"] == "exited" and r["exit_code"] == 0 for r in ranks), ranks
    assert len({r["agent"] for r in ranks}) == 2, f"both ranks on one agent: {ranks}"
    assert {r["agent_name"] for r in ranks} == set(AGENTS), ranks
    return output(pool, job)


def test_big_messages_between_agents_sealed_and_not_match_mpiexec(pool: Pool) -> None:
    reference = real_mpiexec(PROGRAM, 2)
    lines = reference.decode().splitlines()
    assert len(lines) == 25 and lines[-1] == "exchanged 24 messages", reference.decode()
    assert all(line.endswith(" ok") for line in lines[:-1]), reference.decode()

    # Sealing on: the agents' default (neither said it is off when it started).
    for name in AGENTS:
        assert OFF_WARNING not in agent_log(pool, name), agent_log(pool, name)[-3000:]
    sealed = run_job(pool)
    assert sealed == reference

    # Sealing off: both agents restarted with it off in their config files (each says so).
    # (The log said nothing of it before; `vsdk local restart` starts it afresh.)
    seal_off(pool)
    for name in AGENTS:
        assert OFF_WARNING in agent_log(pool, name), agent_log(pool, name)[-3000:]
    plain = run_job(pool)
    assert plain == sealed == reference
