"""A pool across machines, made of network namespaces (issue 21): set up with the operator's
commands of docs/operating.md only, it runs jobs with the output of `vsdk mpiexec`, and no
volunteer ever receives a connection.

The machines are tests/integration/netpool.py's (root only; the module skips, saying why,
without root, `ip` or `nft`, or where network namespaces cannot be made): a coordinator, relays
relay-0 and relay-1, volunteers agent-0..2 of 2 slots each and alice's `vsdk` on the user's
machine, on one bridge (10.213.77.0/24); the volunteers and the user behind nftables that drop
every new inbound connection, the servers behind docs/operating.md's firewall. Namespaces are
named vpmh<pid>-<machine>, so parallel runs do not meet. The checks share one pool and run in
order: a plain job, a volunteer cut off (its link down), a relay connection black-holed (the
detection time is printed), a relay host that crashes (its wire cut, the relay killed meanwhile,
the machine back once its peers noticed the silence by their pings and failed to connect again;
the detection time is printed) and comes back, and last the volunteers' firewall counters and
sockets. The fixture's teardown stops every process by its pid and
removes every namespace, and fails if anything named vpmh<pid>- is left.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import signal
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.integration.netpool import (
    ADDRESS,
    DEADLINE,
    CannotRun,
    Pool,
    Topology,
    namespaces,
    netns_pids,
    run,
    setup_pool,
    start_relay,
    wait_for,
)

# Exclusive: it measures how soon a cut-off volunteer is noticed against issue 21's 15 s, which
# a busy machine stretched to 17 s (beside the CPU lane), and makes network namespaces.
pytestmark = [pytest.mark.slow, pytest.mark.exclusive]

REPO = Path(__file__).resolve().parents[2]
PI = REPO / "examples" / "pi.py"
PACED = Path(__file__).parent / "programs" / "paced.py"
# 120 rounds 0.1 s apart: a job of 12 s at least, long enough for each fault to happen while it
# runs (it stalls meanwhile: the ring waits for the rank that is cut off).
PACED_ARGS = ("120", "0.1")

TAG = "vpmh"
RELAYS = ("relay-0", "relay-1")
AGENTS = ("agent-0", "agent-1", "agent-2")
# 6 slots for jobs of 4 ranks: room for the ranks of a volunteer that is lost
TOPOLOGY = Topology(relays=RELAYS, agents=AGENTS, slots=2, pool_name="multihost")
OUTBOUND_ONLY = TOPOLOGY.outbound_only
# Agent settings relay_ping_interval 5 s and relay_dead_after 12 s: issue 21 asks for a silently
# dropped connection to be noticed within this.
DETECTION_LIMIT = 15.0

# Every packet between a volunteer and one relay dropped, both ways: no RST, no ICMP, silence.
BLACK_HOLE = """
table inet blackhole {
    chain input {
        type filter hook input priority -10; policy accept;
        ip saddr ADDRESS drop
    }
    chain output {
        type filter hook output priority -10; policy accept;
        ip daddr ADDRESS drop
    }
}
"""

# Run from the coordinator's machine against each outbound-only one: a connection attempt must
# meet silence (dropped), not a refusal (which would mean the firewall let it in).
KNOCK = """
import socket, sys
for host in sys.argv[1:]:
    with socket.socket() as s:
        s.settimeout(0.5)
        try:
            s.connect((host, 9))
            print("open")
        except TimeoutError:
            print("dropped")
        except OSError as exc:
            print(type(exc).__name__)
"""

LOG_TIME = "%Y-%m-%d %H:%M:%S,%f"


def knock(pool: Pool) -> None:
    """Try a connection to each outbound-only machine: each must be dropped and counted; then
    the counters start again from 0 for the checks."""
    hosts = [ADDRESS[m] for m in OUTBOUND_ONLY]
    out = run(pool.net.on("coordinator", sys.executable, "-c", KNOCK, *hosts)).stdout.split()
    assert out == ["dropped"] * len(hosts), out
    for machine in OUTBOUND_ONLY:
        assert pool.net.inbound(machine) >= 1, machine
        pool.net.nft(machine, "reset", "counter", "inet", "volunteer", "inbound")
        assert pool.net.inbound(machine) == 0, machine


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    try:
        with namespaces(TOPOLOGY, TAG, tmp_path_factory.mktemp("multihost")) as made:
            knock(made)
            setup_pool(made)
            yield made
    except CannotRun as exc:
        pytest.skip(str(exc))


# -- the checks, in order ------------------------------------------------------------------------


def events(d: dict, kind: str) -> list[dict]:
    return [e for e in d["events"] if e["kind"] == kind]


def ended(d: dict) -> bool:
    return d["job"]["state"] in ("succeeded", "failed", "cancelled")


def running_with_output(pool: Pool, job: int) -> Callable[[dict], bool]:
    """The job runs on every rank and has printed (its ranks exchanged messages)."""

    def cond(d: dict) -> bool:
        if ended(d):
            raise AssertionError(f"job {job} ended too soon: {d}")
        ranks_run = all(r["state"] == "running" for r in d["ranks"])
        return d["job"]["state"] == "running" and ranks_run and "round 10:" in pool.output(job)

    return cond


def lost_relay(relay: str) -> re.Pattern[str]:
    """An agent's first word on its link to ``relay`` dropping (relay_link.py): the log line's
    time, and why it dropped."""
    return re.compile(
        rf"^(\S+ \S+) WARNING \S+: lost relay {relay} \({re.escape(ADDRESS[relay])}:\d+\) "
        r"with \d+ ranks attached \((.*)\); reconnecting",
        re.M,
    )


def test_a_job_prints_what_vsdk_mpiexec_prints(pool: Pool) -> None:
    want = pool.mpiexec(PI, 4)
    res = pool.vsdk("submit", PI, "-n", "4", "--wait")
    assert res.returncode == 0, (res.stderr.decode(), pool.logs())
    assert res.stdout.decode() == want
    assert "pi is approximately" in want
    res = pool.vsdk("jobs", "--json")
    assert res.returncode == 0, res.stderr.decode()
    d = pool.detail(max(j["id"] for j in json.loads(res.stdout)))
    assert d is not None and d["job"]["state"] == "succeeded", d
    # Round robin over the agents: every volunteer ran a rank.
    assert {pool.agent_name(r["agent"]) for r in d["ranks"]} == set(AGENTS), d
    pool.outbound_only()


def test_a_volunteer_cut_off_is_replaced_and_fenced_when_it_returns(pool: Pool) -> None:
    want = pool.mpiexec(PACED, 4, *PACED_ARGS)
    job = pool.submit(PACED, 4, *PACED_ARGS)
    d = pool.wait_job(job, running_with_output(pool, job), "the job running")
    peers = pool.outbound_only()
    for agent in AGENTS:  # (the check above looked at real connections)
        assert "coordinator" in peers[agent] and peers[agent] & set(RELAYS), peers
    victim_id = d["ranks"][1]["agent"]
    victim = pool.agent_name(victim_id)
    ranks = sorted(r["rank"] for r in d["ranks"] if r["agent"] == victim_id)
    log_at = pool.log(victim).stat().st_size
    pool.net.link(victim, "down")
    cut = time.time()
    try:
        d = pool.wait_job(
            job,
            lambda d: (
                ended(d)
                or all(
                    r["agent"] != victim_id and r["incarnation"] >= 2 and r["state"] == "running"
                    for r in d["ranks"]
                    if r["rank"] in ranks
                )
            ),
            f"ranks {ranks} of {victim} running elsewhere",
        )
        moved = time.time() - cut
    finally:
        pool.net.link(victim, "up")
    lost = [e for e in events(d, "rank_lost") if e["rank"] in ranks]
    assert lost, d["events"]
    noticed = min(e["time"] for e in lost) - cut
    print(f"\n{victim} cut off: its ranks {ranks} lost after {noticed:.1f} s, "
          f"running elsewhere after {moved:.1f} s")  # fmt: skip
    assert noticed <= DETECTION_LIMIT, d["events"]

    d = pool.wait_job(
        job,
        lambda d: len([e for e in events(d, "rank_fenced") if e["rank"] in ranks]) == len(ranks),
        f"the stale ranks on {victim} fenced",
    )
    for e in events(d, "rank_fenced"):
        assert f"incarnation 1 on agent {victim} " in e["message"], e
    d = pool.wait_job(job, ended, "the job's end")
    assert d["job"]["state"] == "succeeded", (d, pool.logs())
    assert pool.output(job) == want
    # The volunteer stopped its stale ranks when told to.
    said = pool.log(victim).read_text(errors="replace")[log_at:]
    for rank in ranks:
        assert re.search(rf"stopping rank {rank} of job {job}: .*replaced by", said), said
    wait_for(
        f"{victim} alive again",
        lambda: pool.agents()[victim]["state"] == "alive",
        logs=pool.logs,
    )


def test_a_silently_dropped_relay_connection_is_noticed_within_15_s(pool: Pool) -> None:
    want = pool.mpiexec(PACED, 4, *PACED_ARGS)
    job = pool.submit(PACED, 4, *PACED_ARGS)
    d = pool.wait_job(job, running_with_output(pool, job), "the job running")
    rank = d["ranks"][0]
    agent, relay = pool.agent_name(rank["agent"]), rank["relay"]
    log = pool.log(agent)
    log_at = log.stat().st_size
    # Whatever noticed it: the pings (relay_dead_after), or the kernel (vpool/sockopts.py:
    # TCP_USER_TIMEOUT 15 s).
    dropped = lost_relay(relay)
    cut = time.time()
    pool.net.nft(agent, "-f", "-", rules=BLACK_HOLE.replace("ADDRESS", ADDRESS[relay]))
    try:
        m = wait_for(
            f"{agent} noticing that {relay} went silent",
            lambda: dropped.search(log.read_text(errors="replace")[log_at:]),
            timeout=40,
            logs=pool.logs,
        )
    finally:
        pool.net.nft(agent, "delete", "table", "inet", "blackhole")
    noticed = dt.datetime.strptime(m[1], LOG_TIME).timestamp() - cut
    print(f"\n{agent} noticed its connection to {relay} black-holed after {noticed:.1f} s: {m[2]}")
    assert noticed <= DETECTION_LIMIT, m[0]
    wait_for(
        f"{agent} reconnected to {relay}",
        lambda: "reconnected to" in log.read_text(errors="replace")[log_at + m.end() :],
        logs=pool.logs,
    )
    d = pool.wait_job(job, ended, "the job's end")
    assert d["job"]["state"] == "succeeded", (d, pool.logs())
    assert pool.output(job) == want
    assert d["job"]["restarts"] == 0, d["events"]  # the ranks waited for their connection
    # And the pool goes on as before.
    res = pool.vsdk("submit", PI, "-n", "4", "--wait")
    assert res.returncode == 0 and res.stdout.decode() == pool.mpiexec(PI, 4), res


def test_a_relay_host_that_crashes_and_comes_back_loses_nothing(pool: Pool) -> None:
    """relay-0's machine crashes as one that loses power: silence first (its wire is cut, so
    the FIN and RST its kernel sends when the relay dies never arrive), until the agents whose
    ranks it holds have noticed by their pings (relay_dead_after) and tried in vain to connect
    again; then the machine is back and the relay is started from the same bundle and data
    directory."""
    relay_toml = tomllib.loads((pool.tmp / "relay-0" / "relay.toml").read_text())
    # The bundle makes the relay write each message to its disk before acknowledging it: what
    # a machine that loses power keeps. A test in one kernel cannot drop the page cache of
    # one machine (and SIGKILL loses none of it), so only the setting is checked here.
    assert relay_toml["fsync"] is True, relay_toml
    want = pool.mpiexec(PACED, 4, *PACED_ARGS)
    job = pool.submit(PACED, 4, *PACED_ARGS)
    d = pool.wait_job(job, running_with_output(pool, job), "the job running")
    # The agents with ranks whose messages relay-0 keeps: each has them attached there.
    homed = sorted({pool.agent_name(r["agent"]) for r in d["ranks"] if r["relay"] == "relay-0"})
    assert homed, d["ranks"]
    log_at = {agent: pool.log(agent).stat().st_size for agent in AGENTS}
    lost = lost_relay("relay-0")

    def said(agent: str) -> str:
        return pool.log(agent).read_text(errors="replace")[log_at[agent] :]

    def all_noticed() -> dict[str, re.Match[str]] | None:
        found = {agent: lost.search(said(agent)) for agent in homed}
        return {a: m for a, m in found.items() if m} if all(found.values()) else None

    def all_tried_again(noticed: dict[str, re.Match[str]]) -> list[str] | None:
        """Why each agent's first attempt to connect again failed. An attempt waits up to 15 s
        (relay_link.CONNECT_TIMEOUT), and the agents keep trying for relay_reconnect (30 s)
        after they noticed: the machine is back well within it."""
        failed = re.compile(r"reconnecting to relay relay-0 \(\S+\): (.*)")
        found = [failed.search(said(a)[m.end() :]) for a, m in noticed.items()]
        return [m[1] for m in found if m] if all(found) else None

    relay = pool.procs["relay-0"]
    pool.net.link("relay-0", "down")
    cut = time.time()
    try:
        relay.send_signal(signal.SIGKILL)
        relay.wait(timeout=DEADLINE)
        wait_for(
            "every process of relay-0's machine gone",
            lambda: not netns_pids(pool.net.ns("relay-0")),
            logs=pool.logs,
        )
        noticed = wait_for(
            f"{', '.join(homed)} noticing that relay-0 went silent",
            all_noticed,
            timeout=40,
            logs=pool.logs,
        )
        tried = wait_for(
            f"{', '.join(homed)} trying to connect to relay-0 again",
            lambda: all_tried_again(noticed),
            timeout=40,
            logs=pool.logs,
        )
    finally:
        pool.net.link("relay-0", "up")
    down = time.time() - cut
    start_relay(pool, "relay-0")  # the same bundle, the same data directory
    for agent, m in noticed.items():
        after = dt.datetime.strptime(m[1], LOG_TIME).timestamp() - cut
        print(f"\n{agent} noticed relay-0's machine gone after {after:.1f} s: {m[2]}")
        assert m[2].startswith("nothing from the relay"), m[0]  # its pings, not a reset
        assert after <= DETECTION_LIMIT, m[0]
    print(f"relay-0's machine cut off for {down:.1f} s; connecting again: {tried}")
    assert not any("refused" in why for why in tried), tried  # nothing answered, not even that
    d = pool.wait_job(job, ended, "the job's end", timeout=180)
    assert d["job"]["state"] == "succeeded", (d, pool.logs())
    assert pool.output(job) == want
    # No rank started again: the relay restarted had every message it acknowledged.
    assert d["job"]["restarts"] == 0, d["events"]
    # Every link to relay-0 that had ranks attached was made again, to the relay restarted.
    for agent, m in noticed.items():
        assert "reconnected to relay relay-0" in said(agent)[m.end() :], pool.logs()
    pool.outbound_only()


def test_no_job_failed_and_no_volunteer_received_a_connection(pool: Pool) -> None:
    res = pool.vsdk("jobs", "--json")
    assert res.returncode == 0, res.stderr.decode()
    states = {j["id"]: j["state"] for j in json.loads(res.stdout)}
    assert len(states) >= 5 and set(states.values()) == {"succeeded"}, states
    pool.outbound_only()
    counts = {m: pool.net.inbound(m) for m in OUTBOUND_ONLY}
    assert counts == dict.fromkeys(OUTBOUND_ONLY, 0), counts
