"""A pool across machines, made of network namespaces (issue 21): set up with the operator's
commands of docs/operating.md only, it runs jobs with the output of `vsdk mpiexec`, and no
volunteer ever receives a connection.

The machines (root only; the module skips, saying why, without root, `ip` or `nft`, or where
network namespaces cannot be made):

    switch        a bridge, one port per machine below (no address of its own)
    coordinator   10.213.77.2    HTTPS 8443   docs/operating.md's firewall: only 8443 comes in
    relay-0       10.213.77.3    TLS 7000     the same firewall, with 7000
    relay-1       10.213.77.4    TLS 7000
    agent-0..2    10.213.77.11-13             volunteers: every new inbound connection dropped
    user          10.213.77.20                alice's `vsdk`, behind the same firewall

Namespaces are named vpmh<pid>-<machine>, so parallel runs do not meet. Traffic goes only
between these addresses: the machine's own network is never touched. The checks share one pool
and run in order: a plain job, a volunteer cut off (its link down), a relay connection
black-holed (the detection time is printed), a relay host killed and restarted, and last the
volunteers' firewall counters and sockets. The fixture's teardown stops every process by its pid
and removes every namespace, and fails if anything named vpmh<pid>- is left.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
PI = REPO / "examples" / "pi.py"
PACED = Path(__file__).parent / "programs" / "paced.py"
# 120 rounds 0.1 s apart: a job of 12 s at least, long enough for each fault to happen while it
# runs (it stalls meanwhile: the ring waits for the rank that is cut off).
PACED_ARGS = ("120", "0.1")

PREFIX = f"vpmh{os.getpid()}-"
OURS = re.compile(r"^vpmh(\d+)-")
SUBNET = "10.213.77"
ADDRESS = {
    "coordinator": f"{SUBNET}.2",
    "relay-0": f"{SUBNET}.3",
    "relay-1": f"{SUBNET}.4",
    "agent-0": f"{SUBNET}.11",
    "agent-1": f"{SUBNET}.12",
    "agent-2": f"{SUBNET}.13",
    "user": f"{SUBNET}.20",
}
SWITCH = "switch"
COORDINATOR_PORT = 8443
RELAY_PORT = 7000
URL = f"https://{ADDRESS['coordinator']}:{COORDINATOR_PORT}"
RELAYS = ("relay-0", "relay-1")
AGENTS = ("agent-0", "agent-1", "agent-2")
OUTBOUND_ONLY = (*AGENTS, "user")
SLOTS = 2  # 6 slots for jobs of 4 ranks: room for the ranks of a volunteer that is lost
DEADLINE = 60.0
# Agent settings relay_ping_interval 5 s and relay_dead_after 12 s: issue 21 asks for a silently
# dropped connection to be noticed within this.
DETECTION_LIMIT = 15.0

# Volunteers and the user: what leaves is answered, nothing new comes in (counted).
OUTBOUND_FIREWALL = """
table inet volunteer {
    counter inbound { }
    chain input {
        type filter hook input priority filter; policy accept;
        ct state established,related accept
        ct state invalid drop
        iif lo accept
        ct state new counter name inbound drop
    }
}
"""

# docs/operating.md, step 5 (no ssh rule: nobody logs in here).
SERVER_FIREWALL = """
flush ruleset

table inet filter {
    chain input {
        type filter hook input priority filter; policy drop;
        ct state established,related accept
        ct state invalid drop
        iif lo accept
        meta l4proto { icmp, ipv6-icmp } accept
        tcp dport PORT accept comment "vpool"
    }
    chain forward {
        type filter hook forward priority filter; policy drop;
    }
}
"""

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


def tool(name: str) -> str | None:
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")


def run(
    argv: list[str], *, stdin: str | None = None, check: bool = True, timeout: float = DEADLINE
) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        [str(a) for a in argv],
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if check and res.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv))} failed ({res.returncode}): {res.stderr}")
    return res


def netns_list() -> list[str]:
    out = run([IP, "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_pids(ns: str) -> list[int]:
    res = run([IP, "netns", "pids", ns], check=False)
    return [int(p) for p in res.stdout.split()] if res.returncode == 0 else []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for(
    what: str,
    done: Callable[[], Any],
    timeout: float = DEADLINE,
    logs: Callable[[], str] | None = None,
) -> Any:
    end = time.monotonic() + timeout
    while True:
        got = done()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not within {timeout:g} s\n{logs() if logs else ''}")
        time.sleep(0.1)


IP = tool("ip") or "ip"
NFT = tool("nft") or "nft"
NSENTER = tool("nsenter") or "nsenter"


class Net:
    """The namespaces this module made, by machine name."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.made: list[str] = []

    def ns(self, machine: str) -> str:
        return self.prefix + machine

    def add(self, machine: str) -> None:
        run([IP, "netns", "add", self.ns(machine)])
        self.made.append(machine)

    def on(self, machine: str, *argv: object) -> list[str]:
        """``argv`` run on ``machine``. nsenter execs it (its pid is the program's) in the
        machine's network namespace only: unlike ``ip netns exec``, which mounts a /sys of its
        own, it leaves the cgroup file systems in view, and the agents sandbox ranks in cgroups
        as on a volunteer's machine."""
        return [NSENTER, f"--net=/run/netns/{self.ns(machine)}", "--", *map(str, argv)]

    def ip(self, machine: str, *args: str) -> None:
        run([IP, "-n", self.ns(machine), *args])

    def nft(self, machine: str, *args: str, rules: str | None = None) -> str:
        return run(self.on(machine, NFT, *args), stdin=rules).stdout

    def build(self) -> None:
        """Each machine wired to the switch (made already) by a veth pair, the firewalls."""
        for machine in ADDRESS:
            self.add(machine)
        for machine in [SWITCH, *ADDRESS]:
            # No IPv6 on the wires (lo keeps ::1): no link-local chatter between machines.
            run(self.on(machine, "sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1"))
            self.ip(machine, "link", "set", "lo", "up")
        self.ip(SWITCH, "link", "add", "br0", "type", "bridge")
        self.ip(SWITCH, "link", "set", "br0", "up")
        for machine, address in ADDRESS.items():
            self.ip(machine, "link", "add", "eth0", "type", "veth",
                    "peer", "name", machine, "netns", self.ns(SWITCH))  # fmt: skip
            self.ip(SWITCH, "link", "set", machine, "master", "br0", "up")
            self.ip(machine, "addr", "add", f"{address}/24", "dev", "eth0")
            self.ip(machine, "link", "set", "eth0", "up")
        self.nft("coordinator", "-f", "-",
                 rules=SERVER_FIREWALL.replace("PORT", str(COORDINATOR_PORT)))  # fmt: skip
        for relay in RELAYS:
            self.nft(relay, "-f", "-", rules=SERVER_FIREWALL.replace("PORT", str(RELAY_PORT)))
        for machine in OUTBOUND_ONLY:
            self.nft(machine, "-f", "-", rules=OUTBOUND_FIREWALL)
            # A packet of no known connection that is not a SYN (one of a connection closed
            # meanwhile) is invalid, not new: the counter counts connection attempts only.
            run(self.on(machine, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_loose=0"))

    def inbound(self, machine: str) -> int:
        """Packets of new inbound connections the firewall of ``machine`` dropped."""
        out = json.loads(self.nft(machine, "-j", "list", "counter", "inet", "volunteer", "inbound"))
        return next(o["counter"]["packets"] for o in out["nftables"] if "counter" in o)

    def link(self, machine: str, state: str) -> None:
        """The switch's end of ``machine``'s wire up or down (down: every packet lost, silently)."""
        self.ip(SWITCH, "link", "set", machine, state)


class Pool:
    """The pool on the namespaces: its processes (by name: coordinator, relay-N, agent-N), their
    logs and the operator's and the user's commands."""

    def __init__(self, tmp: Path, net: Net) -> None:
        self.tmp = tmp
        self.net = net
        self.dir = tmp / "pool"
        self.config = self.dir / "coordinator.toml"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.machine: dict[str, str] = {}
        self.log_files: dict[str, IO[bytes]] = {}
        self.agent_ids: dict[str, str] = {}  # agent id -> name
        self.user_home = tmp / "user" / "home"
        self.references: dict[tuple[str, ...], str] = {}
        (tmp / "logs").mkdir()
        (tmp / "run").mkdir()

    # -- processes ------------------------------------------------------------------------------

    def env(self, home: Path) -> dict[str, str]:
        clean = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("VPOOL_") and not k.lower().endswith("_proxy")
        }
        return {**clean, "VPOOL_HOME": str(home)}

    def log(self, name: str) -> Path:
        return self.tmp / "logs" / f"{name}.log"

    def ready_file(self, name: str) -> Path:
        return self.tmp / "run" / f"{name}.json"

    def start(self, name: str, machine: str, *argv: object) -> subprocess.Popen[bytes]:
        if name in self.log_files:
            self.log_files[name].close()
        self.log_files[name] = self.log(name).open("ab")  # a restart appends
        self.ready_file(name).unlink(missing_ok=True)
        proc = subprocess.Popen(
            self.net.on(machine, *argv, "--ready-file", self.ready_file(name)),
            env=self.env(self.tmp / "home" / name),
            stdin=subprocess.DEVNULL,
            stdout=self.log_files[name],
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs[name] = proc
        self.machine[name] = machine
        return proc

    def ready(self, name: str, timeout: float = DEADLINE) -> dict[str, Any]:
        """The ready file of ``name``, once written, checked to come from the process this pool
        started, on its machine."""
        proc, path = self.procs[name], self.ready_file(name)

        def written() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited with {proc.returncode}\n{self.logs()}")
            return path.exists() and path.stat().st_size > 0

        wait_for(f"{name} ready", written, timeout, self.logs)
        info = json.loads(path.read_text())
        assert info["pid"] == proc.pid, (name, info, proc.pid)  # nsenter exec'd it
        where = run([IP, "netns", "identify", str(proc.pid)]).stdout.strip()
        assert where == self.net.ns(self.machine[name]), (name, where)
        return info

    def stop(self) -> list[str]:
        """SIGTERM to every process of the pool, SIGKILL to those still there after a while;
        what did not stop in time."""
        slow = []
        order = [n for n in self.procs if n.startswith("agent")]
        order += [n for n in self.procs if n.startswith("relay")] + ["coordinator"]
        for name in order:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + 30
        for name in order:
            proc = self.procs.get(name)
            if proc is None:
                continue
            try:
                proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                slow.append(name)
                proc.kill()
                proc.wait(timeout=DEADLINE)
        for f in self.log_files.values():
            f.close()
        return slow

    def logs(self) -> str:
        out = []
        for path in sorted((self.tmp / "logs").glob("*.log")):
            out.append(f"----- {path.name}\n{path.read_text(errors='replace')[-5000:]}")
        return "\n".join(out)

    # -- the operator, on the coordinator's machine ----------------------------------------------

    def vpc(self, *args: object) -> str:
        argv = self.net.on("coordinator", BIN / "vpool-coordinator", *args, "--config", self.config)
        res = subprocess.run(
            argv,
            env=self.env(self.tmp / "home" / "operator"),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            check=False,
        )
        assert res.returncode == 0, f"vpool-coordinator {args}: {res.stderr}"
        return res.stdout

    def agents(self) -> dict[str, dict[str, str]]:
        """`agent list`: name -> its row."""
        lines = self.vpc("agent", "list").splitlines()
        head = lines[0].split("\t")
        rows = [dict(zip(head, line.split("\t"), strict=False)) for line in lines[1:]]
        return {row["name"]: row for row in rows}

    # -- the user, on hers -------------------------------------------------------------------------

    def vsdk(self, *args: object, timeout: float = 180) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            self.net.on("user", BIN / "vsdk", *args),
            env=self.env(self.user_home),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=timeout,
            check=False,
        )

    def submit(self, program: Path, ranks: int, *args: str) -> int:
        res = self.vsdk("submit", program, "--ranks", ranks, "--json", "--", *args)
        assert res.returncode == 0, res.stderr.decode()
        return int(json.loads(res.stdout)["id"])

    def detail(self, job: int) -> dict[str, Any] | None:
        res = self.vsdk("status", job, "--json", timeout=30)
        return json.loads(res.stdout) if res.returncode == 0 else None

    def wait_job(self, job: int, cond: Callable[[dict], bool], what: str, timeout=120.0) -> dict:
        last: list[dict | None] = [None]

        def check() -> dict | None:
            last[0] = d = self.detail(job)
            return d if d is not None and cond(d) else None

        try:
            return wait_for(what, check, timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last {last[0]}\n{self.logs()}") from None

    def output(self, job: int) -> str:
        res = self.vsdk("logs", job)
        assert res.returncode == 0, res.stderr.decode()
        return res.stdout.decode()

    def mpiexec(self, program: Path, ranks: int, *args: str) -> str:
        """What `vsdk mpiexec` prints, run on the user's machine (it needs no pool)."""
        key = (str(program), str(ranks), *args)
        if key not in self.references:
            res = self.vsdk("mpiexec", "-q", "-n", ranks, "python", program, *args)
            assert res.returncode == 0, res.stderr.decode()
            self.references[key] = res.stdout.decode()
        return self.references[key]

    def agent_name(self, agent_id: str) -> str:
        return self.agent_ids[agent_id]

    def outbound_only(self) -> dict[str, set[str]]:
        """On every volunteer's and the user's machine: no TCP listener but on loopback, and
        every TCP connection is one it made, to the coordinator or a relay (or on loopback).
        Returns the servers each machine is connected to."""
        servers = {f"{ADDRESS['coordinator']}:{COORDINATOR_PORT}": "coordinator"}
        servers |= {f"{ADDRESS[r]}:{RELAY_PORT}": r for r in RELAYS}
        peers: dict[str, set[str]] = {}
        for machine in OUTBOUND_ONLY:
            peers[machine] = set()
            listening = run(self.net.on(machine, "ss", "-tlnH")).stdout.split("\n")
            for line in filter(None, listening):
                assert line.split()[3].startswith(("127.", "[::1]")), (machine, line)
            conns = run(self.net.on(machine, "ss", "-tnH", "state", "established")).stdout
            for line in filter(None, conns.split("\n")):
                local, peer = line.split()[2:4]
                if local.startswith(("127.", "[::1]")) and peer.startswith(("127.", "[::1]")):
                    continue
                assert local.startswith(ADDRESS[machine] + ":"), (machine, line)
                assert peer in servers, (machine, line)
                peers[machine].add(servers[peer])
        return peers


def remove_leftovers() -> None:
    """Namespaces of an earlier run of this module that died before its teardown (their pid in
    the name is gone): removed when nothing runs in them any more, else left for a person."""
    for ns in netns_list():
        m = OURS.match(ns)
        if not m or int(m[1]) == os.getpid() or alive(int(m[1])):
            continue
        if netns_pids(ns):
            print(f"leftover namespace {ns} still has processes: left alone")
            continue
        run([IP, "netns", "delete", ns], check=False)


def setup_pool(pool: Pool) -> None:
    """docs/operating.md, steps 2 to 7, each machine's part on that machine."""
    net, tmp = pool.net, pool.tmp
    init = ["init", "--public-url", URL, "--dir", pool.dir, "--pool-name", "multihost"]
    res = run(net.on("coordinator", BIN / "vpool-coordinator", *init))
    assert "relay add" in res.stdout, res.stdout
    pool.start("coordinator", "coordinator", BIN / "vpool-coordinator", "serve",
               "--config", pool.config)  # fmt: skip
    for relay in RELAYS:
        # The bundle is made on the coordinator and copied to the relay's machine: here they
        # share a file system, so it is written where the relay reads it.
        bundle = tmp / relay
        pool.vpc("relay", "add", relay, "--address", f"{ADDRESS[relay]}:{RELAY_PORT}",
                 "--bundle", bundle, "--install-dir", bundle)  # fmt: skip
    info = pool.ready("coordinator")
    assert info["url"] == URL, info
    for relay in RELAYS:
        start_relay(pool, relay)

    def registered() -> bool:
        rows = pool.vpc("relay", "list").splitlines()[1:]
        states = {row.split("\t")[0]: row.split("\t")[2:4] for row in rows}
        want = {r: ["alive", f"{ADDRESS[r]}:{RELAY_PORT}"] for r in RELAYS}
        return states == want

    wait_for("relays registered", registered, logs=pool.logs)

    for agent in AGENTS:
        token = pool.vpc("join-token", "create", "--uses", "1", "--label", agent).strip()
        assert token.startswith("vpj_"), token
        home = tmp / agent
        home.mkdir(mode=0o700)
        shutil.copy(pool.dir / "ca.pem", home / "ca.pem")  # given to the volunteer
        # docs/operating.md's agent.toml, plus what sets apart three agents that share this
        # file system (a volunteer's machine has its own: the defaults do there).
        config = home / "agent.toml"
        config.touch(mode=0o600)
        config.write_text(
            f'coordinator_url = "{URL}"\n'
            f'coordinator_ca = "{home / "ca.pem"}"\n'
            f'join_token = "{token}"\n'
            f"slots = {SLOTS}\n"
            f'name = "{agent}"\n'
            f'work_dir = "{home / "work"}"\n'
            f'identity_dir = "{home / "identity"}"\n'
        )
        pool.start(agent, agent, BIN / "vpool-agent", "--config", config)
    for agent in AGENTS:
        info = pool.ready(agent)
        pool.agent_ids[info["agent_id"]] = agent

    token = pool.vpc("user", "add", "alice").strip()
    assert token.startswith("vpt_"), token
    ca = tmp / "user" / "pool-ca.pem"
    ca.parent.mkdir(mode=0o700)
    shutil.copy(pool.dir / "ca.pem", ca)
    res = pool.vsdk("login", URL, "--token", token, "--ca", ca)
    assert res.returncode == 0, res.stderr.decode()

    def agents_ready() -> bool:
        rows = pool.agents()
        return all(rows.get(a, {}).get("state") == "alive" for a in AGENTS)

    wait_for("agents alive", agents_ready, logs=pool.logs)


def start_relay(pool: Pool, relay: str) -> None:
    pool.start(relay, relay, BIN / "vpool-relay", "--config", pool.tmp / relay / "relay.toml")
    pool.ready(relay)


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


def teardown(pool: Pool | None, net: Net) -> None:
    slow = pool.stop() if pool is not None else []
    # What our processes started (ranks, a relay's store process) runs on our machines too.
    for machine in net.made:
        for pid in netns_pids(net.ns(machine)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for machine in net.made:
        wait_for(f"nothing left running on {machine}", lambda m=machine: not netns_pids(net.ns(m)))
    for machine in reversed(net.made):
        run([IP, "netns", "delete", net.ns(machine)], check=False)
    if pool is not None:
        for agent in AGENTS:
            # The agents' checkpoint scratch directories (agent setting checkpoint_scratch),
            # which they leave behind, empty.
            tag = hashlib.sha256(str(pool.tmp / agent / "work").encode()).hexdigest()[:12]
            scratch = Path(f"/dev/shm/vpool-ckpt-{os.getuid()}-{tag}")
            if scratch.is_dir():
                shutil.rmtree(scratch)
    left = [ns for ns in netns_list() if ns.startswith(PREFIX)]
    links = [line for line in run([IP, "-o", "link"]).stdout.splitlines() if PREFIX in line]
    assert not left and not links, (left, links)
    assert not slow, f"did not stop within 30 s of SIGTERM: {slow}"


def cannot_run() -> str:
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "needs root: it makes network namespaces and nftables firewalls"
    for name in ("ip", "nft", "ss", "nsenter"):
        if tool(name) is None:
            return f"needs {name} (scripts/test installs iproute2, nftables and util-linux)"
    return ""


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    why = cannot_run()
    if why:
        pytest.skip(why)
    remove_leftovers()
    used = run([IP, "-o", "addr"]).stdout + run([IP, "route"]).stdout
    if f"{SUBNET}." in used:
        pytest.skip(f"this machine uses {SUBNET}.0/24 already")
    net = Net(PREFIX)
    made: Pool | None = None
    try:
        try:
            net.add(SWITCH)
        except AssertionError as exc:
            pytest.skip(f"cannot make a network namespace: {exc}")
        net.build()
        made = Pool(tmp_path_factory.mktemp("multihost"), net)
        knock(made)
        setup_pool(made)
        yield made
    finally:
        teardown(made, net)


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
    # The link's first word on the drop (relay_link.py), whatever noticed it: the pings
    # (relay_dead_after), or the kernel (vpool/sockopts.py: TCP_USER_TIMEOUT 15 s).
    dropped = re.compile(
        rf"^(\S+ \S+) WARNING \S+: lost relay {relay} \({re.escape(ADDRESS[relay])}:\d+\) "
        r"with \d+ ranks attached \((.*)\); reconnecting",
        re.M,
    )
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
    want = pool.mpiexec(PACED, 4, *PACED_ARGS)
    job = pool.submit(PACED, 4, *PACED_ARGS)
    pool.wait_job(job, running_with_output(pool, job), "the job running")
    log_at = {agent: pool.log(agent).stat().st_size for agent in AGENTS}
    relay = pool.procs["relay-0"]
    relay.send_signal(signal.SIGKILL)
    relay.wait(timeout=DEADLINE)
    wait_for(
        "every process of relay-0's machine gone",
        lambda: not netns_pids(pool.net.ns("relay-0")),
        logs=pool.logs,
    )
    start_relay(pool, "relay-0")  # the same bundle, the same data directory
    d = pool.wait_job(job, ended, "the job's end", timeout=180)
    assert d["job"]["state"] == "succeeded", (d, pool.logs())
    assert pool.output(job) == want
    # The job's connections to relay-0 broke, and were made again to the relay restarted.
    back = [
        agent
        for agent in AGENTS
        if "reconnected to relay relay-0"
        in pool.log(agent).read_text(errors="replace")[log_at[agent] :]
    ]
    assert back, pool.logs()
    pool.outbound_only()


def test_no_job_failed_and_no_volunteer_received_a_connection(pool: Pool) -> None:
    res = pool.vsdk("jobs", "--json")
    assert res.returncode == 0, res.stderr.decode()
    states = {j["id"]: j["state"] for j in json.loads(res.stdout)}
    assert len(states) >= 5 and set(states.values()) == {"succeeded"}, states
    pool.outbound_only()
    counts = {m: pool.net.inbound(m) for m in OUTBOUND_ONLY}
    assert counts == dict.fromkeys(OUTBOUND_ONLY, 0), counts
