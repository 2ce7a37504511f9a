"""Chaos runner: a job on a local pool while rank processes and agents are SIGKILLed.

    .venv/bin/python benchmarks/chaos.py [options] [PROGRAM [-- ARGS...]]

1. starts a local pool (``vsdk local up``) in a temporary VPOOL_HOME;
2. runs PROGRAM once without faults and keeps its output and wall time;
3. runs it again while killing things: a random rank process every ``--kill-rank-every`` seconds
   on average, a whole agent every ``--kill-agent-every`` seconds (restarted after
   ``--agent-down`` seconds so the pool keeps its capacity), optionally the relays
   (``--relay-restarts``) and the coordinator (``--coordinator-restarts``), SIGKILLed and started
   again on the same disk at random moments;
4. checks the output is byte-identical to the fault-free run and prints completion time over
   fault-free time, the faults injected, and the job's fault events.

With ``--checkpoint-every SECONDS`` both runs are submitted with ``vsdk submit
--checkpoint-every``: a killed rank is then restored from its newest image (events
``rank_restored``) instead of replaying from the beginning (``rank_replaying``), and the slowdown
is that of faults on a checkpointing job. Run it with and without to compare the two.

Everything is bounded: the chaos run is cancelled after ``--limit`` seconds (default: 10 x the
fault-free time + 60 s), the pool is always stopped at the end, and only processes this runner
started (the pool's recorded pids and their rank children) are signalled. Exit code 0 when the
output is identical, 1 otherwise.

Example (issue 4's target: one rank every 10 s, one agent every 30 s, 8 ranks on 4 agents x 2;
20000 steps take about 80 s without faults on a 2-core machine):

    .venv/bin/python benchmarks/chaos.py examples/heat.py -- 20000
    .venv/bin/python benchmarks/chaos.py --checkpoint-every 10 examples/heat.py -- 20000
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from vpool.sdk.client import Client
from vpool.sdk.errors import VsdkError

BIN = Path(sys.executable).parent
VSDK = str(BIN / "vsdk")
POLL = 0.2


@dataclass
class Fault:
    at: float  # seconds since the chaos run started
    what: str  # rank | agent | relay | coordinator
    target: str
    pid: int
    wall: float = 0.0  # time.time() of the kill (the coordinator's event clock)
    rank: int | None = None  # the MPI rank of a killed rank process


@dataclass
class Run:
    output: bytes
    seconds: float
    state: str
    detail: dict = field(default_factory=dict)


def stop_cleanly_on_sigterm() -> None:
    """SIGTERM (and SIGINT, which a shell's background job ignores) end the benchmark like an
    error: its ``finally`` stops the pool it started and removes the pool's directory."""

    def leave(signum: int, frame: object) -> None:
        # Once: `timeout` passes its SIGTERM on, and a second one would cut the cleanup short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, leave)


class Pool:
    """The local pool this runner started, known by its recorded pids."""

    def __init__(self, home: str, env: dict[str, str]) -> None:
        self.home = home
        self.env = env
        self._client: Client | None = None

    def client(self) -> Client:
        """An in-process client of the pool's coordinator (``vsdk``'s own, from the pool's
        client.toml): a poll through it costs a request, where a ``vsdk`` process costs about
        0.4 s of CPU taken from the ranks."""
        if self._client is None:
            self._client = Client.from_config(Path(self.home) / "config" / "client.toml")
        return self._client

    def vsdk(self, *args: str, timeout: float = 300, check: bool = True) -> str:
        out = subprocess.run(
            [VSDK, *args],
            env=self.env,
            stdin=subprocess.DEVNULL,  # --wait would give a pipe we inherited to rank 0
            capture_output=True,
            timeout=timeout,
            check=False,
        )
        if check and out.returncode != 0:
            raise RuntimeError(
                f"vsdk {' '.join(args)} failed ({out.returncode}): {out.stderr.decode()[-2000:]}"
            )
        return out.stdout.decode()

    def processes(self) -> dict[str, int]:
        # Exits 1 while some component is down (an agent the runner killed): still JSON.
        status = json.loads(self.vsdk("local", "status", "--json", check=False))
        return {p["name"]: p["pid"] for p in status["processes"] if p["state"] == "running"}

    def rank_pids(self, program: str, job: int | None = None) -> list[tuple[str, int]]:
        """(agent name, pid) of every rank process the pool's agents run for ``program``
        (of ``job`` only, if given)."""
        agents = {n: p for n, p in self.processes().items() if n.startswith("agent-")}
        return [(agent, pid) for agent, pid, _ in rank_processes(agents, program, job)]


def rank_processes(
    agents: dict[str, int], program: str, job: int | None = None
) -> list[tuple[str, int, int]]:
    """(agent name, pid, MPI rank) of the rank processes running ``program`` under ``agents``
    (name -> pid).

    Searched among all descendants: a rank runs in its sandbox (bwrap, then the sandbox's
    init), a restored one under the restore's init, not as the agent's child. A process counts
    when its command line is ``python PROGRAM ...`` (CRIU restores the original one) and its
    environment has ``VPOOL_RANK``; a checkpoint clone has both too, so processes whose stdout
    is ``/dev/null`` (what a clone points it at) or whose parent is itself a rank process of
    the program (a clone just forked) are left out."""
    name = Path(program).name
    found = []
    for agent, root in agents.items():
        candidates = {}
        for pid, parent in _descendants(root):
            # ``python PROGRAM``: not the sandbox's bwrap or init, whose command lines name it.
            cmdline = _cmdline(pid)
            if len(cmdline) < 2 or Path(cmdline[1]).name != name:
                continue
            env = _environ(pid)
            if b"VPOOL_RANK" not in env:
                continue
            if job is not None and env.get(b"VPOOL_JOB") != str(job).encode():
                continue
            candidates[pid] = (parent, env)
        for pid, (parent, env) in candidates.items():
            if parent in candidates or _stdout(pid) == "/dev/null":
                continue
            try:
                found.append((agent, pid, int(env[b"VPOOL_RANK"])))
            except ValueError:
                continue
    return found


def _descendants(root: int, limit: int = 10_000) -> list[tuple[int, int]]:
    """(pid, parent pid) of every process below ``root`` (at most ``limit``)."""
    out: list[tuple[int, int]] = []
    todo = [root]
    while todo and len(out) < limit:
        parent = todo.pop()
        for child in children(parent):
            out.append((child, parent))
            todo.append(child)
    return out


def _environ(pid: int) -> dict[bytes, bytes]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return {}


def _stdout(pid: int) -> str:
    try:
        return os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        return ""


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for item in f.read().split(b"\0"):
                if item.startswith(b"VPOOL_RANK="):
                    return int(item.split(b"=", 1)[1])
    except (OSError, ValueError):
        pass
    return None


def _kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def submit(
    pool: Pool, program: str, ranks: int, args: list[str], checkpoint_every: float = 0.0
) -> int:
    flags = ["--checkpoint-every", f"{checkpoint_every:g}"] if checkpoint_every > 0 else []
    out = pool.vsdk("submit", program, "--ranks", str(ranks), *flags, "--json", "--", *args)
    return int(json.loads(out)["id"])


def job_state(pool: Pool, job: int) -> dict | None:
    """The job's detail (as ``vsdk status --json`` prints it), or None while the coordinator
    does not answer (it may be restarting)."""
    try:
        return msgspec.to_builtins(pool.client().status(job))
    except VsdkError:  # ApiError, and transport errors as VsdkError
        return None


def _state_of(detail: dict) -> str:
    job = detail.get("job", detail)
    return str(job.get("state", "?"))


TERMINAL = {"succeeded", "failed", "cancelled"}


def wait_job(pool: Pool, job: int, limit: float, tick=None, poll: float = POLL) -> tuple[str, dict]:
    """The job's terminal state and detail, asking every ``poll`` s (one request each)."""
    deadline = time.monotonic() + limit
    detail: dict = {}
    while time.monotonic() < deadline:
        got = job_state(pool, job)
        if got is not None:
            detail = got
            if _state_of(detail) in TERMINAL:
                return _state_of(detail), detail
        if tick is not None:
            tick()
        time.sleep(poll)
    pool.vsdk("cancel", str(job), check=False)
    return "timed out", detail


def fault_free(
    pool: Pool,
    program: str,
    ranks: int,
    args: list[str],
    limit: float,
    checkpoint_every: float = 0.0,
) -> Run:
    t0 = time.monotonic()
    job = submit(pool, program, ranks, args, checkpoint_every)
    state, detail = wait_job(pool, job, limit)
    seconds = time.monotonic() - t0
    return Run(pool.vsdk("logs", str(job)).encode(), seconds, state, detail)


class Chaos:
    def __init__(self, pool: Pool, opts: argparse.Namespace, rng: random.Random) -> None:
        self.pool = pool
        self.opts = opts
        self.rng = rng
        self.faults: list[Fault] = []
        self.job: int | None = None  # set once submitted: only its ranks are killed
        self.t0 = time.monotonic()
        self.next_rank = self._after(opts.kill_rank_every)
        self.next_agent = self._after(opts.kill_agent_every)
        self.agent_back: dict[str, float] = {}  # agent name -> when to restart it
        self.restarts: list[tuple[float, str]] = []  # (at, component) relay/coordinator kills
        span = opts.expected
        for what, count in (
            ("relay", opts.relay_restarts),
            ("coordinator", opts.coordinator_restarts),
        ):
            for _ in range(count):
                self.restarts.append((rng.uniform(0.2 * span, 0.7 * span), what))
        self.restarts.sort()

    def _after(self, mean: float) -> float:
        if mean <= 0:
            return float("inf")
        return self.now() + self.rng.expovariate(1.0 / mean)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def tick(self) -> None:
        now = self.now()
        for name, when in list(self.agent_back.items()):
            if now >= when:
                del self.agent_back[name]
                self.pool.vsdk("local", "restart", name, check=False)
        if now >= self.next_rank:
            self.next_rank = self._after(self.opts.kill_rank_every)
            ranks = self.pool.rank_pids(self.opts.program, self.job)
            if ranks:
                agent, pid = self.rng.choice(ranks)
                mpi_rank = _rank_of(pid)
                if _kill(pid):
                    self.faults.append(
                        Fault(
                            now, "rank", f"rank {mpi_rank} on {agent}", pid, time.time(), mpi_rank
                        )
                    )
        if now >= self.next_agent:
            self.next_agent = self._after(self.opts.kill_agent_every)
            agents = {n: p for n, p in self.pool.processes().items() if n.startswith("agent-")}
            if agents:
                name = self.rng.choice(sorted(agents))
                if _kill(agents[name]):
                    self.faults.append(Fault(now, "agent", name, agents[name]))
                    self.agent_back[name] = now + self.opts.agent_down
        while self.restarts and now >= self.restarts[0][0]:
            _, what = self.restarts.pop(0)
            procs = self.pool.processes()
            names = sorted(n for n in procs if n == what or n.startswith(f"{what}-"))
            if not names:
                continue
            name = self.rng.choice(names)
            if _kill(procs[name]):
                self.faults.append(Fault(now, what, name, procs[name]))
                self.pool.vsdk("local", "restart", name, check=False)

    def finish(self) -> None:
        """Bring back agents still down, so the pool is whole for the next run."""
        for name in list(self.agent_back):
            self.pool.vsdk("local", "restart", name, check=False)
        self.agent_back.clear()


def replacement_times(faults: list[Fault], events: list[dict]) -> list[float]:
    """For each killed rank process: seconds from the kill to the coordinator's event saying the
    rank's next incarnation runs (both clocks are this machine's)."""
    out = []
    for f in faults:
        if f.what != "rank" or f.rank is None:
            continue
        for e in events:
            if e.get("kind") == "rank_running" and e.get("rank") == f.rank and e["time"] > f.wall:
                out.append(e["time"] - f.wall)
                break
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("program", nargs="?", default="examples/heat.py")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--agents", type=int, default=4)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--relays", type=int, default=2)
    ap.add_argument("--kill-rank-every", type=float, default=10.0, help="mean s (0: never)")
    ap.add_argument("--kill-agent-every", type=float, default=30.0, help="mean s (0: never)")
    ap.add_argument("--agent-down", type=float, default=2.0, help="s before a killed agent returns")
    ap.add_argument("--relay-restarts", type=int, default=0)
    ap.add_argument("--coordinator-restarts", type=int, default=0)
    ap.add_argument(
        "--checkpoint-every",
        type=float,
        default=0.0,
        help="submit both runs with checkpoints every this many s (0: none, replay only)",
    )
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--limit", type=float, default=0.0, help="s before the chaos run is cancelled")
    ap.add_argument("--json", default="", help="also write the figures to this file")
    argv = sys.argv[1:]
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    opts = ap.parse_args(argv)
    opts.args = extra
    rng = random.Random(opts.seed)
    with tempfile.TemporaryDirectory(prefix="vpool-chaos-") as home:
        env = {**os.environ, "VPOOL_HOME": home}
        pool = Pool(home, env)
        pool.vsdk(
            "local",
            "up",
            "--agents",
            str(opts.agents),
            "--relays",
            str(opts.relays),
            "--slots",
            str(opts.slots),
            timeout=180,
        )
        try:
            every = opts.checkpoint_every
            base = fault_free(pool, opts.program, opts.ranks, opts.args, 3600, every)
            if base.state != "succeeded":
                print(f"chaos: the fault-free run {base.state}: {base.detail}", file=sys.stderr)
                return 1
            opts.expected = base.seconds
            limit = opts.limit or 10 * base.seconds + 60
            chaos = Chaos(pool, opts, rng)
            job = submit(pool, opts.program, opts.ranks, opts.args, every)
            chaos.job = job
            state, detail = wait_job(pool, job, limit, tick=chaos.tick)
            seconds = chaos.now()
            chaos.finish()
            out = pool.vsdk("logs", str(job), check=False).encode()
        finally:
            pool.vsdk("local", "down", check=False, timeout=120)
    identical = state == "succeeded" and out == base.output
    events = detail.get("events", []) if detail else []
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e.get("kind", "?")] = kinds.get(e.get("kind", "?"), 0) + 1
    print(f"program         {opts.program} {' '.join(opts.args)} on {opts.ranks} ranks")
    print(f"pool            {opts.agents} agents x {opts.slots} slots, {opts.relays} relays")
    every = opts.checkpoint_every
    print(f"checkpoints     {f'every {every:g} s' if every > 0 else 'off (replay only)'}")
    print(f"fault-free      {base.seconds:.1f} s")
    print(f"with faults     {seconds:.1f} s ({state})")
    print(f"slowdown        {seconds / base.seconds:.2f}x")
    print(
        f"faults injected {len(chaos.faults)}: "
        + ", ".join(f"{f.what} {f.target} at {f.at:.1f} s" for f in chaos.faults)
    )
    print(f"job events      {kinds}")
    waits = replacement_times(chaos.faults, events)
    if waits:
        waits.sort()
        print(
            f"rank kill -> replacement running: median {waits[len(waits) // 2]:.2f} s, "
            f"max {waits[-1]:.2f} s over {len(waits)} kills"
        )
    print(f"output          {'identical' if identical else 'DIFFERENT'} ({len(out)} bytes)")
    if opts.json:
        Path(opts.json).write_text(
            json.dumps(
                {
                    "program": opts.program,
                    "args": opts.args,
                    "ranks": opts.ranks,
                    "checkpoint_every": opts.checkpoint_every,
                    "fault_free_s": base.seconds,
                    "chaos_s": seconds,
                    "state": state,
                    "slowdown": seconds / base.seconds,
                    "identical": identical,
                    "faults": [f.__dict__ for f in chaos.faults],
                    "events": events,
                },
                indent=1,
            )
        )
    if not identical and state == "succeeded":
        sys.stderr.write("--- fault-free output\n" + base.output.decode()[-2000:])
        sys.stderr.write("--- output with faults\n" + out.decode()[-2000:])
    return 0 if identical else 1


if __name__ == "__main__":
    stop_cleanly_on_sigterm()
    sys.exit(main())
