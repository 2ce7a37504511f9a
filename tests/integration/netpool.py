"""A vpool pool across machines made of network namespaces, set up with the operator's commands
of docs/operating.md only: the harness of tests/integration/test_multihost.py, which
benchmarks/wan_pool.py reuses for its WAN figures.

The machines (root only; ``cannot_run`` says why it cannot be made here):

    switch        a bridge, one port per machine below (no address of its own)
    coordinator   10.213.77.2    HTTPS 8443   docs/operating.md's firewall: only 8443 comes in
    relay-0       10.213.77.3    TLS 7000     the same firewall, with 7000
    relay-1       10.213.77.4    TLS 7000
    agent-0..2    10.213.77.11-13             volunteers: every new inbound connection dropped
    user          10.213.77.20                alice's `vsdk`, behind the same firewall

A ``Topology`` picks the relays and agents a pool has (the coordinator and the user are always
there) and the agents' slots. Namespaces are named <tag><pid>-<machine>, so parallel runs do
not meet, and ``remove_leftovers`` finds those of a run that died before its teardown. Traffic
goes only between these addresses: the machine's own network is never touched.

    with netpool.namespaces(topology, tag, tmp) as pool:   # wired, firewalled, nothing runs
        netpool.setup_pool(pool)                           # coordinator, relays, agents, user
        pool.vsdk("submit", ...)

Leaving the block stops every process by its pid (``Pool.stop``, then SIGKILL to whatever else
runs on the machines), removes every namespace and fails if anything named <tag><pid>- is left.
"""

from __future__ import annotations

import contextlib
import functools
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
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

BIN = Path(sys.executable).parent
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
DEADLINE = 60.0

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


@dataclass(frozen=True)
class Topology:
    """The relays and agents of a pool (names of ``ADDRESS``), and each agent's slots."""

    relays: tuple[str, ...]
    agents: tuple[str, ...]
    slots: int
    pool_name: str

    @property
    def machines(self) -> list[str]:
        """Every machine but the switch, in ``ADDRESS``'s order."""
        ours = {"coordinator", *self.relays, *self.agents, "user"}
        return [m for m in ADDRESS if m in ours]

    @property
    def outbound_only(self) -> tuple[str, ...]:
        """The machines behind ``OUTBOUND_FIREWALL``."""
        return (*self.agents, "user")


class CannotRun(Exception):
    """This machine cannot make the namespaces (the message says why)."""


def tool(name: str) -> str | None:
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")


IP = tool("ip") or "ip"
NFT = tool("nft") or "nft"
NSENTER = tool("nsenter") or "nsenter"


def run(
    argv: list[Any], *, stdin: str | None = None, check: bool = True, timeout: float = DEADLINE
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


def idle(ns: str) -> bool:
    """Nothing runs in namespace ``ns``."""
    return not netns_pids(ns)


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


class Net:
    """The namespaces this module made, by machine name."""

    def __init__(self, prefix: str, topology: Topology) -> None:
        self.prefix = prefix
        self.topology = topology
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
        machines = self.topology.machines
        for machine in machines:
            self.add(machine)
        for machine in [SWITCH, *machines]:
            # No IPv6 on the wires (lo keeps ::1): no link-local chatter between machines.
            run(self.on(machine, "sysctl", "-qw", "net.ipv6.conf.default.disable_ipv6=1"))
            self.ip(machine, "link", "set", "lo", "up")
        self.ip(SWITCH, "link", "add", "br0", "type", "bridge")
        self.ip(SWITCH, "link", "set", "br0", "up")
        for machine in machines:
            self.ip(machine, "link", "add", "eth0", "type", "veth",
                    "peer", "name", machine, "netns", self.ns(SWITCH))  # fmt: skip
            self.ip(SWITCH, "link", "set", machine, "master", "br0", "up")
            self.ip(machine, "addr", "add", f"{ADDRESS[machine]}/24", "dev", "eth0")
            self.ip(machine, "link", "set", "eth0", "up")
        self.nft("coordinator", "-f", "-",
                 rules=SERVER_FIREWALL.replace("PORT", str(COORDINATOR_PORT)))  # fmt: skip
        for relay in self.topology.relays:
            self.nft(relay, "-f", "-", rules=SERVER_FIREWALL.replace("PORT", str(RELAY_PORT)))
        for machine in self.topology.outbound_only:
            self.nft(machine, "-f", "-", rules=OUTBOUND_FIREWALL)
            # A packet of no known connection that is not a SYN (one of a connection closed
            # meanwhile) is invalid, not new: the counter counts connection attempts only.
            run(self.on(machine, "sysctl", "-qw", "net.netfilter.nf_conntrack_tcp_loose=0"))

    def inbound(self, machine: str) -> int:
        """Packets of new inbound connections the firewall of ``machine`` dropped."""
        out = json.loads(self.nft(machine, "-j", "list", "counter", "inet", "volunteer", "inbound"))
        return int(next(o["counter"]["packets"] for o in out["nftables"] if "counter" in o))

    def link(self, machine: str, state: str) -> None:
        """The switch's end of ``machine``'s wire up or down (down: every packet lost, silently)."""
        self.ip(SWITCH, "link", "set", machine, state)


class Pool:
    """The pool on the namespaces: its processes (by name: coordinator, relay-N, agent-N, and
    whatever else a caller starts), their logs and the operator's and the user's commands."""

    def __init__(self, tmp: Path, net: Net) -> None:
        self.tmp = tmp
        self.net = net
        self.topology = net.topology
        self.dir = tmp / "pool"
        self.config = self.dir / "coordinator.toml"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.machine: dict[str, str] = {}
        self.log_files: dict[str, IO[bytes]] = {}
        self.agent_ids: dict[str, str] = {}  # agent id -> name
        self.user_home = tmp / "user" / "home"
        self.references: dict[tuple[str, ...], str] = {}
        # Environment of every relay started (``start_relay``), over its bundle's settings.
        self.relay_env: dict[str, str] = {}
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

    def start(
        self, name: str, machine: str, *argv: object, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        """``argv --ready-file FILE`` started on ``machine`` as process ``name`` (``env`` added
        to its environment)."""
        if name in self.log_files:
            self.log_files[name].close()
        self.log_files[name] = self.log(name).open("ab")  # a restart appends
        self.ready_file(name).unlink(missing_ok=True)
        proc = subprocess.Popen(
            self.net.on(machine, *argv, "--ready-file", self.ready_file(name)),
            env={**self.env(self.tmp / "home" / name), **(env or {})},
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
        info: dict[str, Any] = json.loads(path.read_text())
        assert info["pid"] == proc.pid, (name, info, proc.pid)  # nsenter exec'd it
        where = run([IP, "netns", "identify", str(proc.pid)]).stdout.strip()
        assert where == self.net.ns(self.machine[name]), (name, where)
        return info

    def stop(self) -> list[str]:
        """SIGTERM to every process of the pool, SIGKILL to those still there after a while;
        what did not stop in time. What a caller started besides the pool goes first, then
        the agents, the relays and the coordinator."""
        slow = []
        pool = [n for n in self.procs if n.startswith("agent")]
        pool += [n for n in self.procs if n.startswith("relay")] + ["coordinator"]
        order = [n for n in self.procs if n not in pool] + pool
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

    def wait_job(
        self,
        job: int,
        cond: Callable[[dict[str, Any]], bool],
        what: str,
        timeout: float = 120.0,
    ) -> dict[str, Any]:
        last: list[dict[str, Any] | None] = [None]

        def check() -> dict[str, Any] | None:
            last[0] = d = self.detail(job)
            return d if d is not None and cond(d) else None

        try:
            got: dict[str, Any] = wait_for(what, check, timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}; last {last[0]}\n{self.logs()}") from None
        return got

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
        servers |= {f"{ADDRESS[r]}:{RELAY_PORT}": r for r in self.topology.relays}
        peers: dict[str, set[str]] = {}
        for machine in self.topology.outbound_only:
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


def remove_leftovers(tag: str) -> None:
    """Namespaces of an earlier run that died before its teardown (named <tag><pid>-, its pid
    gone): removed when nothing runs in them any more, else left for a person."""
    ours = re.compile(rf"^{re.escape(tag)}(\d+)-")
    for ns in netns_list():
        m = ours.match(ns)
        if not m or int(m[1]) == os.getpid() or alive(int(m[1])):
            continue
        if netns_pids(ns):
            print(f"leftover namespace {ns} still has processes: left alone")
            continue
        run([IP, "netns", "delete", ns], check=False)


def setup_pool(pool: Pool) -> None:
    """docs/operating.md, steps 2 to 7, each machine's part on that machine."""
    net, tmp, topology = pool.net, pool.tmp, pool.topology
    init = ["init", "--public-url", URL, "--dir", pool.dir, "--pool-name", topology.pool_name]
    made = run(net.on("coordinator", BIN / "vpool-coordinator", *init))
    assert "relay add" in made.stdout, made.stdout
    pool.start("coordinator", "coordinator", BIN / "vpool-coordinator", "serve",
               "--config", pool.config)  # fmt: skip
    for relay in topology.relays:
        # The bundle is made on the coordinator and copied to the relay's machine: here they
        # share a file system, so it is written where the relay reads it.
        bundle = tmp / relay
        pool.vpc("relay", "add", relay, "--address", f"{ADDRESS[relay]}:{RELAY_PORT}",
                 "--bundle", bundle, "--install-dir", bundle)  # fmt: skip
    info = pool.ready("coordinator")
    assert info["url"] == URL, info
    for relay in topology.relays:
        start_relay(pool, relay)

    def registered() -> bool:
        rows = pool.vpc("relay", "list").splitlines()[1:]
        states = {row.split("\t")[0]: row.split("\t")[2:4] for row in rows}
        want = {r: ["alive", f"{ADDRESS[r]}:{RELAY_PORT}"] for r in topology.relays}
        return states == want

    wait_for("relays registered", registered, logs=pool.logs)

    for agent in topology.agents:
        token = pool.vpc("join-token", "create", "--uses", "1", "--label", agent).strip()
        assert token.startswith("vpj_"), token
        home = tmp / agent
        home.mkdir(mode=0o700)
        shutil.copy(pool.dir / "ca.pem", home / "ca.pem")  # given to the volunteer
        # docs/operating.md's agent.toml, plus what sets apart agents that share this file
        # system (a volunteer's machine has its own: the defaults do there).
        config = home / "agent.toml"
        config.touch(mode=0o600)
        config.write_text(
            f'coordinator_url = "{URL}"\n'
            f'coordinator_ca = "{home / "ca.pem"}"\n'
            f'join_token = "{token}"\n'
            f"slots = {topology.slots}\n"
            f'name = "{agent}"\n'
            f'work_dir = "{home / "work"}"\n'
            f'identity_dir = "{home / "identity"}"\n'
        )
        pool.start(agent, agent, BIN / "vpool-agent", "--config", config)
    for agent in topology.agents:
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
        return all(rows.get(a, {}).get("state") == "alive" for a in topology.agents)

    wait_for("agents alive", agents_ready, logs=pool.logs)


def start_relay(pool: Pool, relay: str) -> None:
    """``relay`` started from its bundle on its machine (``pool.relay_env`` added)."""
    pool.start(relay, relay, BIN / "vpool-relay", "--config", pool.tmp / relay / "relay.toml",
               env=pool.relay_env)  # fmt: skip
    pool.ready(relay)


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
        wait_for(f"nothing left running on {machine}", functools.partial(idle, net.ns(machine)))
    for machine in reversed(net.made):
        run([IP, "netns", "delete", net.ns(machine)], check=False)
    if pool is not None:
        for agent in net.topology.agents:
            # The agents' checkpoint scratch directories (agent setting checkpoint_scratch),
            # which they leave behind, empty.
            tag = hashlib.sha256(str(pool.tmp / agent / "work").encode()).hexdigest()[:12]
            scratch = Path(f"/dev/shm/vpool-ckpt-{os.getuid()}-{tag}")
            if scratch.is_dir():
                shutil.rmtree(scratch)
    left = [ns for ns in netns_list() if ns.startswith(net.prefix)]
    links = [line for line in run([IP, "-o", "link"]).stdout.splitlines() if net.prefix in line]
    assert not left and not links, (left, links)
    assert not slow, f"did not stop within 30 s of SIGTERM: {slow}"


def cannot_run() -> str:
    """Why the namespaces cannot be made here ("" if they can, as far as one can tell)."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "needs root: it makes network namespaces and nftables firewalls"
    for name in ("ip", "nft", "ss", "nsenter"):
        if tool(name) is None:
            return f"needs {name} (scripts/test installs iproute2, nftables and util-linux)"
    return ""


@contextlib.contextmanager
def namespaces(topology: Topology, tag: str, tmp: Path) -> Iterator[Pool]:
    """The machines of ``topology`` made and wired (namespaces named <tag><pid>-<machine>),
    and a ``Pool`` on them whose files go under ``tmp``, not set up yet (``setup_pool``). On
    the way out, whatever happened: ``teardown``. Raises ``CannotRun`` (before anything is
    made) where the namespaces cannot be made, or this machine uses their subnet."""
    why = cannot_run()
    if why:
        raise CannotRun(why)
    remove_leftovers(tag)
    used = run([IP, "-o", "addr"]).stdout + run([IP, "route"]).stdout
    if f"{SUBNET}." in used:
        raise CannotRun(f"this machine uses {SUBNET}.0/24 already")
    net = Net(f"{tag}{os.getpid()}-", topology)
    made: Pool | None = None
    try:
        try:
            net.add(SWITCH)
        except AssertionError as exc:
            raise CannotRun(f"cannot make a network namespace: {exc}") from None
        net.build()
        made = Pool(tmp, net)
        yield made
    finally:
        teardown(made, net)
