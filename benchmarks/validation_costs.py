"""What validation by replay costs: wall time and CPU on a real pool, and what adaptive sampling
re-executes against forged results.

    .venv/bin/python benchmarks/validation_costs.py [--quick] [--repeat N] [--jobs 400]
                                                    [--only pool|sampling] [--json FILE]

Two parts, each with its baseline measured in the same invocation:

1. **A real pool.** ``vsdk local up --agents 3 --relays 2`` in a temporary VPOOL_HOME (stopped
   at the end whatever happens; each local agent has its own join token, so they count as
   unrelated). examples/heat.py (``--steps``, ``--cells``: 1000 steps of 200,000 cells per
   rank, about 9 s on 4 ranks on 2 cores; ``--quick``: 300 x 50,000, one repetition) is
   submitted plain and with ``--validate``, the order alternating, ``--repeat`` times
   (default 3), after one plain warm-up job. The coordinator runs with
   ``validation_trusted_after`` set beyond reach (environment), so that every rank of every
   validated job is re-executed, as for an agent's first ten agreements: part 2 measures the
   sampling. Per mode, medians of:

   - the wall time of ``vsdk submit --wait`` (submit to end), and the coordinator's own
     created -> finished, the validated job's split at its ``validating`` event;
   - CPU seconds: of the rank processes (everything below the agents, their sandboxes
     included), of the relays, of the agents themselves and of the coordinator.

   Validation's CPU cost is (validated - plain) / plain rank CPU (every rank re-executed once:
   about 1.0 expected), the relays' extra likewise against their plain CPU.

   How rank CPU is read. A rank runs below its agent (bwrap, the sandbox's init, the
   program), and the sandbox's init reaps it; but on this machine the agents' cutime + cstime
   (/proc/PID/stat fields 16-17) grew by 0-1% of what the rank processes were seen to
   use: the CPU of a rank is lost somewhere between its sandbox and the agent (where was not
   tracked down). So a thread reads /proc every ``POLL`` (20 ms): for each child of an
   agent (a sandbox's bwrap, the checkpoint worker), the utime + stime + cutime + cstime of
   every process below it, keeping the largest sum seen per child. Rank CPU = the growth of
   those sums, or the growth of the agents' cutime + cstime for the children that ended,
   when that is larger (reaped by the agent after all). What a process uses in its last
   20 ms is missed (about 1% of a validated job's rank CPU); what the meter itself uses is
   printed. The relays' and the coordinator's CPU is their utime + stime (fields 14-15).

   Every validated job's output must equal the plain job's, and ``vsdk status JOB --json``
   must say every rank's validation is "agreed": the benchmark fails otherwise.

2. **Adaptive sampling**, in this process: the real coordinator (``Coordinator``,
   ``create_app``, driven through ``httpx.ASGITransport`` with a fake clock, as the
   coordinator tests do) with ``validation_trusted_after`` 10 and ``validation_min_rate`` 0.1,
   one relay (registered; it answers every re-execution ``RelayValidated(agreed=True)``: the
   forgeries here are of stdout, which relays do not see), ``--honest`` honest agents and one
   hostile agent that prints a forged stdout for a rank with probability ``--forge``
   (0.2), whether it runs the rank or re-executes it. ``--jobs`` validated jobs (default 400)
   of 1 or 2 ranks, one after another; before each, every agent's heartbeat reports a random
   number of free slots, so the coordinator's own placement (most free slots first) spreads
   ranks and re-executions over the agents. Python's ``random`` is seeded (``--seed``):
   the agents' keys, the free slots, the jobs' sizes and the forgeries; the coordinator
   samples with ``secrets.SystemRandom``, so two runs give other counts, and the report gives
   measured fractions. Per window of ``--window`` jobs (50): the fraction of ranks re-executed, of
   the honest agents' and of the hostile agent's; executions per rank; forgeries by the
   hostile agent as the original, caught (the job's output for that rank is the true one) or
   missed (the forged output is the job's result). Totals against BOINC-style replication,
   every rank run twice (and a third time on a disagreement).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import trio
from chaos import Pool, children, stop_cleanly_on_sigterm
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from vpool.coordinator import keys
from vpool.coordinator.app import create_app
from vpool.coordinator.service import Coordinator
from vpool.coordinator.settings import CoordinatorSettings
from vpool.protocol import api
from vpool.protocol.tokens import sign_possession

HERE = Path(__file__).resolve().parent
HEAT = str(HERE.parent / "examples" / "heat.py")
TICK = os.sysconf("SC_CLK_TCK")
POLL = 0.02  # s between reads of /proc by the CPU meter
NEVER_TRUSTED = 10**9  # validation_trusted_after for part 1: every rank re-executed


# -- part 1: a real pool ----------------------------------------------------------------------


def _stat(pid: int) -> tuple[int, list[float]] | None:
    """(start time, [utime, stime, cutime, cstime] in seconds) of ``pid``, None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    # fields[0] is field 3 of proc(5): utime..cstime are fields 14-17, starttime 22.
    return int(fields[19]), [int(x) / TICK for x in fields[11:15]]


def _subtree_cpu(pid: int) -> float:
    """utime + stime + cutime + cstime of ``pid`` and every process below it: all the CPU the
    subtree used, as long as each process that ended was reaped inside it."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        st = _stat(p)
        if st is not None:
            total += sum(st[1])
            todo += children(p)
    return total


@dataclass
class Reading:
    meter: float  # CpuMeter.cost
    own: dict[str, float]  # name -> utime + stime of each pool process
    reaped: dict[str, float]  # agent name -> its cutime + cstime
    below: dict[tuple[str, int, int], float]  # (agent, pid, start) of its children -> subtree


class CpuMeter:
    """CPU of the pool's processes (their pids from pids.json), read every ``POLL`` s by a
    thread; see the module docstring."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.below: dict[tuple[str, int, int], float] = {}
        self.cost = 0.0  # CPU seconds the polling thread used
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuMeter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(POLL):
            self.poll()
            self.cost = time.thread_time()

    def poll(self) -> set[tuple[str, int, int]]:
        """Read every agent's children once; the keys of those alive."""
        alive = set()
        for name, pid in self.pids.items():
            if not name.startswith("agent-"):
                continue
            for child in children(pid):
                st = _stat(child)
                if st is None:
                    continue
                key = (name, child, st[0])
                cpu = _subtree_cpu(child)
                alive.add(key)
                with self._lock:
                    self.below[key] = max(cpu, self.below.get(key, 0.0))
        return alive

    def read(self) -> tuple[Reading, set[tuple[str, int, int]]]:
        alive = self.poll()
        own, reaped = {}, {}
        for name, pid in self.pids.items():
            st = _stat(pid)
            if st is None:
                raise RuntimeError(f"{name} (pid {pid}) is gone")
            own[name] = st[1][0] + st[1][1]
            reaped[name] = st[1][2] + st[1][3]
        with self._lock:
            below = dict(self.below)
        return Reading(self.cost, own, reaped, below), alive

    def since(self, start: Reading) -> dict[str, float]:
        """CPU seconds used since ``start``, by part."""
        end, alive = self.read()
        grown = {k: v - start.below.get(k, 0.0) for k, v in end.below.items()}
        tracked = sum(grown.values())
        tracked_ended = sum(v for k, v in grown.items() if k not in alive)
        agents = [n for n in self.pids if n.startswith("agent-")]
        reaped = sum(end.reaped[n] - start.reaped[n] for n in agents)

        def own(prefix: str) -> float:
            return sum(end.own[n] - start.own[n] for n in self.pids if n.startswith(prefix))

        return {
            "ranks": tracked + max(0.0, reaped - tracked_ended),
            "ranks_tracked": tracked,
            "agents_cutime": reaped,
            "relays": own("relay-"),
            "agents": own("agent-"),
            "coordinator": own("coordinator"),
            "meter": end.meter - start.meter,
        }


def _settle(meter: CpuMeter, limit: float = 10.0) -> None:
    """Until no sandbox (bwrap) is left below an agent: every rank process has ended."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        left = [
            c
            for name, pid in meter.pids.items()
            if name.startswith("agent-")
            for c in children(pid)
            if _cmdline(c)[:1] and Path(_cmdline(c)[0]).name == "bwrap"
        ]
        if not left:
            return
        time.sleep(POLL)


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def run_job(
    pool: Pool, meter: CpuMeter, args: list[str], ranks: int, validate: bool, name: str
) -> dict[str, Any]:
    _settle(meter)
    start, _ = meter.read()
    t0 = time.monotonic()
    cmd = ["submit", HEAT, "--ranks", str(ranks), "--name", name, "--wait", "--quiet"]
    out = pool.vsdk(*cmd, *(["--validate"] if validate else []), "--", *args, timeout=1800)
    wall = time.monotonic() - t0
    _settle(meter)
    cpu = meter.since(start)
    [job] = [j for j in json.loads(pool.vsdk("jobs", "--json")) if j["name"] == name]
    detail = json.loads(pool.vsdk("status", str(job["id"]), "--json"))
    info = detail["job"]
    if info["state"] != "succeeded" or bool(info.get("validate")) != validate:
        raise RuntimeError(f"job {info['id']} ({validate=}): {json.dumps(info)}")
    validating = [e["time"] for e in detail["events"] if e["kind"] == "validating"]
    res: dict[str, Any] = {
        "job": info["id"],
        "wall_s": wall,
        "job_s": info["finished"] - info["created"],
        "cpu": cpu,
        "output": out,
    }
    if validate:
        verdicts = {r["rank"]: r.get("validation") for r in detail["ranks"]}
        if set(verdicts.values()) != {"agreed"} or len(verdicts) != ranks or not validating:
            raise RuntimeError(
                f"job {info['id']}: not every rank was re-executed and agreed: {verdicts} "
                f"({info.get('validation')})"
            )
        res["run_s"] = validating[0] - info["created"]
        res["validation_s"] = info["finished"] - validating[0]
        res["validated_by"] = {r["rank"]: r.get("validated_by") for r in detail["ranks"]}
    return res


def measure_pool(opts: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "validated": []}
    args = [str(opts.steps), str(opts.cells)]
    with tempfile.TemporaryDirectory(prefix="vpool-validation-bench-") as home:
        env = {
            **os.environ,
            "VPOOL_HOME": home,
            "VPOOL_COORDINATOR_VALIDATION_TRUSTED_AFTER": str(NEVER_TRUSTED),
        }
        pool = Pool(home, env)
        pool.vsdk("local", "up", "--agents", "3", "--relays", "2", "--quiet", timeout=180)
        try:
            listed = json.loads(Path(home, "state", "local-pool", "pids.json").read_text())
            pids = {p["name"]: int(p["pid"]) for p in listed}
            with CpuMeter(pids) as meter:
                warm = run_job(pool, meter, args, opts.ranks, False, "warm-up")
                _say(f"  warm-up: {warm['wall_s']:.1f} s")
                for i in range(opts.repeat):
                    for validate in (False, True) if i % 2 == 0 else (True, False):
                        mode = "validated" if validate else "plain"
                        run = run_job(pool, meter, args, opts.ranks, validate, f"{mode}-{i}")
                        if run["output"] != warm["output"]:
                            raise RuntimeError(
                                f"job {run['job']} ({mode}) printed other output than the "
                                f"warm-up job {warm['job']}:\n{run['output'][-2000:]}\n---\n"
                                f"{warm['output'][-2000:]}"
                            )
                        runs[mode].append(run)
                        _say(
                            f"  {mode} #{i}: job {run['job']}, {run['wall_s']:.1f} s, rank CPU "
                            f"{run['cpu']['ranks']:.2f} s, relays {run['cpu']['relays']:.2f} s"
                        )
        finally:
            pool.vsdk("local", "down", check=False, timeout=120)
    return runs


def _median(runs: list[dict[str, Any]], *path: str) -> float:
    vals = []
    for r in runs:
        v: Any = r
        for key in path:
            v = v[key]
        vals.append(float(v))
    return statistics.median(vals)


def report_pool(
    opts: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]
) -> dict[str, float]:
    plain, val = runs["plain"], runs["validated"]
    print(
        f"\n1. a real pool: examples/heat.py {opts.steps} {opts.cells} on {opts.ranks} ranks, "
        f"3 agents, 2 relays; medians of {len(plain)} plain and {len(val)} validated job(s), "
        "every rank of a validated job re-executed"
    )
    rows: list[tuple[str, float, float, str]] = []
    out: dict[str, float] = {}

    def row(label: str, key: str, p: float, v: float, ratio: str) -> None:
        rows.append((label, p, v, ratio))
        out[f"{key}_plain"], out[f"{key}_validated"] = p, v

    p, v = _median(plain, "wall_s"), _median(val, "wall_s")
    row("wall, vsdk submit --wait (s)", "wall_s", p, v, f"{v / p:.2f}x")
    out["wall_ratio"] = v / p
    p, v = _median(plain, "job_s"), _median(val, "job_s")
    row("job, created -> finished (s)", "job_s", p, v, f"{v / p:.2f}x")
    out["job_ratio"] = v / p
    v_run, v_val = _median(val, "run_s"), _median(val, "validation_s")
    row("  of it: the ranks' run (s)", "run_s", p, v_run, f"{v_run / p:.2f}x")
    row("  of it: validating (s)", "validation_s", 0.0, v_val, f"+{v_val / p:.2f}x")
    for part, label in (
        ("ranks", "CPU, rank processes (s)"),
        ("relays", "CPU, relays (s)"),
        ("agents", "CPU, agents themselves (s)"),
        ("coordinator", "CPU, coordinator (s)"),
    ):
        p, v = _median(plain, "cpu", part), _median(val, "cpu", part)
        row(label, f"cpu_{part}", p, v, f"+{(v - p) / p:.2f}x" if p > 0 else "-")
        out[f"cpu_{part}_extra"] = (v - p) / p if p > 0 else 0.0
    print(f"{'':32}{'plain':>10}{'validated':>12}{'ratio':>10}")
    for label, p, v, ratio in rows:
        shown_p = f"{p:10.2f}" if p or "validating" not in label else f"{'-':>10}"
        print(f"{label:32}{shown_p}{v:12.2f}{ratio:>10}")
    print(
        "ratio: validated / plain; +x: (validated - plain) / plain, the extra as a multiple of "
        "the plain job's"
    )
    ranks_p, ranks_v = _median(plain, "cpu", "ranks"), _median(val, "cpu", "ranks")
    print(
        f"validation's CPU: {ranks_v - ranks_p:.2f} s more in rank processes, "
        f"{out['cpu_ranks_extra']:.2f}x the plain job's ({ranks_v / ranks_p:.2f}x in all; "
        "1.0x extra expected with every rank re-executed once); relays "
        f"+{out['cpu_relays_extra']:.2f}x"
    )
    seen = [r["cpu"]["agents_cutime"] / r["cpu"]["ranks_tracked"] for r in plain + val]
    meter = [r["cpu"]["meter"] for r in plain + val]
    print(
        f"rank CPU read from /proc every {POLL * 1000:.0f} ms (the meter used "
        f"{statistics.median(meter):.2f} s of CPU per job); the agents' cutime + cstime grew "
        f"by {statistics.median(seen):.0%} of it (median over jobs)"
    )
    print("validated jobs: output identical to the plain jobs', every rank agreed")
    for r in val:
        print(f"  job {r['job']}: re-executed by {r['validated_by']}")
    return out


# -- part 2: adaptive sampling -----------------------------------------------------------------

RELAY, RELAY_TOKEN = "relay-0", "vpr_validation-costs-relay"
APP = b"from mpi4py import MPI\nprint(MPI.COMM_WORLD.Get_rank())\n"  # never run here
SANDBOX = api.IsolationReport(level="sandbox", checkpoints=True)
SLOTS = 64  # random free slots from 1 to this: ties (broken by agent id) are rare


class FakeClock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


@dataclass
class SimAgent:
    name: str
    id: str
    headers: dict[str, str]
    hostile: bool


@dataclass
class Window:
    jobs: int = 0
    ranks: int = 0
    sampled: int = 0  # ranks re-executed (a first re-execution)
    executions: int = 0  # originals, re-executions and third executions
    honest_ranks: int = 0
    honest_sampled: int = 0
    hostile_ranks: int = 0
    hostile_sampled: int = 0
    forged: int = 0  # ranks the hostile agent ran and forged
    caught: int = 0  # of them, the job's output for the rank is the true one
    missed: int = 0  # of them, the forged output is the job's result
    lies: int = 0  # re-executions the hostile agent forged
    lies_outvoted: int = 0
    wrong_results: int = 0  # ranks whose job output is not the true one, whoever forged it
    third: int = 0

    def add(self, other: Window) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class Sim:
    client: httpx.AsyncClient
    core: Coordinator
    clock: FakeClock
    rng: random.Random
    forge: float
    user: dict[str, str] = field(default_factory=dict)
    agents: dict[str, SimAgent] = field(default_factory=dict)
    bundle: str = ""

    async def post(self, url: str, body: object, headers: dict[str, str]) -> httpx.Response:
        r = await self.client.post(url, content=msgspec.json.encode(body), headers=headers)
        if r.status_code >= 300:
            raise RuntimeError(f"POST {url}: {r.status_code} {r.text}")
        return r

    async def get(self, url: str, type_: type[Any]) -> Any:
        r = await self.client.get(url, headers=self.user)
        if r.status_code >= 300:
            raise RuntimeError(f"GET {url}: {r.status_code} {r.text}")
        return msgspec.json.decode(r.content, type=type_)

    async def enroll(self, name: str, hostile: bool) -> None:
        key = Ed25519PrivateKey.from_private_bytes(self.rng.randbytes(32))
        pub, sig = sign_possession(key, self.clock())
        req = api.EnrollRequest(
            public_key=pub, timestamp=self.clock(), signature=sig, name=name, slots=SLOTS
        )
        resp = msgspec.json.decode(
            (await self.post("/api/v1/agents/enroll", req, {})).content, type=api.EnrollResponse
        )
        headers = {"Authorization": f"Bearer {resp.agent_token}"}
        self.agents[resp.agent_id] = SimAgent(name, resp.agent_id, headers, hostile)

    async def heartbeat(self, agent: SimAgent, free: int) -> None:
        hb = api.AgentHeartbeat(ranks=[], free_slots=free, isolation=SANDBOX)
        await self.post("/api/v1/agents/heartbeat", hb, agent.headers)

    async def lease(self, agent: SimAgent) -> list[api.Lease]:
        req = api.LeaseRequest(free_slots=SLOTS, wait=0.0)
        r = await self.post("/api/v1/agents/lease", req, agent.headers)
        return msgspec.json.decode(r.content, type=api.LeaseResponse).leases

    async def run(self, agent: SimAgent, lease: api.Lease, truth: bytes) -> bool:
        """The agent runs (or re-executes) the rank: prints its stdout, forged if hostile and
        it decides to, and exits 0. Whether it forged."""
        forged = agent.hostile and self.rng.random() < self.forge
        data = truth.replace(b"checksum", b"checksum 0, not") if forged else truth
        chunk = api.OutputChunk(
            job=lease.job,
            rank=lease.rank,
            incarnation=lease.incarnation,
            stream="stdout",
            offset=0,
            data=data,
        )
        await self.post("/api/v1/agents/output", api.OutputBatch(chunks=[chunk]), agent.headers)
        ex = api.RankExit(job=lease.job, rank=lease.rank, incarnation=lease.incarnation, code=0)
        await self.post("/api/v1/agents/exit", ex, agent.headers)
        return forged

    async def verdict(self, lease: api.Lease) -> None:
        """The relay's verdict: the re-execution sent the logged messages."""
        report = api.RelayValidated(
            name=RELAY, job=lease.job, rank=lease.rank, incarnation=lease.incarnation, agreed=True
        )
        await self.post("/api/v1/relays/validated", report, _relay_headers())

    async def job(self, n: int) -> Window:
        """One validated job, from submission to its end; what came of it."""
        self.clock.now += 1.0
        await self.post(
            "/api/v1/relays/heartbeat",
            api.RelayHeartbeat(name=RELAY, load=api.RelayLoad()),
            _relay_headers(),
        )
        for agent in self.agents.values():
            await self.heartbeat(agent, self.rng.randint(1, SLOTS))
        ranks = self.rng.choice((1, 2))
        sub = api.JobSubmit(
            ranks=ranks, bundle=self.bundle, entry="app.py", name=f"sim-{n}", validate=True
        )
        r = await self.post("/api/v1/jobs", sub, self.user)
        job = msgspec.json.decode(r.content, type=api.JobInfo).id
        truth = {rank: _true_output(job, rank) for rank in range(ranks)}
        w = Window(jobs=1, ranks=ranks)
        detail = await self.get(f"/api/v1/jobs/{job}", api.JobDetail)
        if detail.job.state != "running":
            raise RuntimeError(f"job {job} was not placed: {detail.job.waiting}")
        original = {ri.rank: self.agents[str(ri.agent)] for ri in detail.ranks}
        forged_original: set[int] = set()
        for agent_id in dict.fromkeys(a.id for a in original.values()):
            agent = self.agents[agent_id]
            for lease in await self.lease(agent):
                w.executions += 1
                if await self.run(agent, lease, truth[lease.rank]):
                    forged_original.add(lease.rank)
        lied: set[int] = set()
        for _ in range(10):  # a first re-execution, maybe a third one
            detail = await self.get(f"/api/v1/jobs/{job}", api.JobDetail)
            if detail.job.state != "running":
                break
            placed = {str(ri.agent) for ri in detail.ranks if ri.state == "leased"}
            if not placed:
                raise RuntimeError(f"job {job} waits: {detail.job.validation}")
            for agent_id in placed:
                agent = self.agents[agent_id]
                for lease in await self.lease(agent):
                    w.executions += 1
                    if await self.run(agent, lease, truth[lease.rank]):
                        lied.add(lease.rank)
                    await self.verdict(lease)
        else:
            raise RuntimeError(f"job {job} did not end: {detail.job.validation}")
        if detail.job.state != "succeeded":
            raise RuntimeError(f"job {job} {detail.job.state}: {detail.job.reason}")
        page = await self.get(f"/api/v1/jobs/{job}/output?after=0", api.OutputPage)
        result = {rank: b"" for rank in range(ranks)}
        for rec in page.records:
            if rec.stream == "stdout":
                result[rec.rank] += rec.data
        w.third = sum(
            e.kind == "rank_validating" and "third time" in e.message for e in detail.events
        )
        for ri in detail.ranks:
            sampled = ri.validation != "skipped"
            w.sampled += sampled
            if original[ri.rank].hostile:
                w.hostile_ranks += 1
                w.hostile_sampled += sampled
            else:
                w.honest_ranks += 1
                w.honest_sampled += sampled
            right = result[ri.rank] == truth[ri.rank]
            w.wrong_results += not right
            if ri.rank in forged_original:
                w.forged += 1
                w.caught += right
                w.missed += not right
            if ri.rank in lied:
                w.lies += 1
                w.lies_outvoted += right
        return w


def _true_output(job: int, rank: int) -> bytes:
    """What an honest run of ``rank`` of ``job`` prints."""
    digest = hashlib.sha256(f"{job} {rank}".encode()).hexdigest()
    return f"job {job} rank {rank}: checksum {digest}\n".encode()


def _relay_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {RELAY_TOKEN}"}


def _zip(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return buf.getvalue()


async def simulate(opts: argparse.Namespace) -> list[Window]:
    with tempfile.TemporaryDirectory(prefix="vpool-validation-sim-") as state:
        clock = FakeClock()
        settings = CoordinatorSettings(
            state_dir=state,
            open_enrollment=True,
            insecure_http=True,
            heartbeat_interval=1.0,
            agent_timeout=15.0,
            relay_timeout=15.0,
            pool_name="validation-costs",
            validation_trusted_after=opts.trusted_after,
            validation_min_rate=opts.min_rate,
        )
        core = Coordinator(settings, clock=clock)
        try:
            core.store.add_relay_key(RELAY, keys.hash_token(RELAY_TOKEN), clock(), replace=True)
            token, token_hash = keys.new_api_token()
            core.store.add_user("bench", token_hash, clock(), role="user")
            transport = httpx.ASGITransport(app=create_app(settings, coordinator=core))
            async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as c:
                sim = Sim(c, core, clock, random.Random(opts.seed), opts.forge)
                sim.user = {"Authorization": f"Bearer {token}"}
                register = api.RelayRegister(name=RELAY, host="127.0.0.1", port=7000)
                await sim.post("/api/v1/relays/register", register, _relay_headers())
                for i in range(opts.honest):
                    await sim.enroll(f"honest-{i}", hostile=False)
                await sim.enroll("hostile", hostile=True)
                data = _zip({"app.py": APP})
                sim.bundle = hashlib.sha256(data).hexdigest()
                r = await c.put(f"/api/v1/blobs/{sim.bundle}", content=data, headers=sim.user)
                if r.status_code >= 300:
                    raise RuntimeError(f"upload: {r.status_code} {r.text}")
                windows: list[Window] = []
                for n in range(opts.jobs):
                    if n % opts.window == 0:
                        windows.append(Window())
                    windows[-1].add(await sim.job(n))
                return windows
        finally:
            core.close()


def _frac(a: int, b: int) -> str:
    return f"{a / b:.2f}" if b else "-"


def _row(label: str, w: Window) -> str:
    return (
        f"{label:>9}{w.ranks:>7}{_frac(w.sampled, w.ranks):>9}"
        f"{_frac(w.honest_sampled, w.honest_ranks):>8}"
        f"{_frac(w.hostile_sampled, w.hostile_ranks):>9}{w.hostile_ranks:>5}"
        f"{_frac(w.executions, w.ranks):>10}"
        f"{w.forged:>8}{w.caught:>8}{w.missed:>8}{w.lies:>6}{w.wrong_results:>7}"
    )


def report_sampling(opts: argparse.Namespace, windows: list[Window], took: float) -> dict[str, Any]:
    print(
        f"\n2. adaptive sampling: the real coordinator in-process, {opts.honest} honest agents "
        f"and 1 hostile agent forging a rank's stdout with probability {opts.forge:g}, "
        f"{opts.jobs} validated jobs of 1-2 ranks, validation_trusted_after "
        f"{opts.trusted_after}, validation_min_rate {opts.min_rate:g} (seed {opts.seed}; the "
        f"coordinator samples with its own randomness; {took:.1f} s)"
    )
    head = (
        f"{'jobs':>9}{'ranks':>7}{'re-exec':>9}{'honest':>8}{'hostile':>9}{'of':>5}{'exec/rank':>10}"
        f"{'forged':>8}{'caught':>8}{'missed':>8}{'lies':>6}{'wrong':>7}"
    )
    print(head)
    total = Window()
    first = 0
    for w in windows:
        total.add(w)
        print(_row(f"{first + 1}-{first + w.jobs}", w))
        first += w.jobs
    t = total
    print(_row("all", t))
    print(
        "re-exec: fraction of ranks re-executed (honest: of the ranks honest agents ran; "
        "hostile: of the hostile agent's, 'of' of them); exec/rank: executions per rank, the "
        "original included; forged: the hostile agent's forged originals, caught (the job's "
        "output is the true one) or missed (the forgery is the job's result); lies: "
        "re-executions it forged; wrong: ranks whose job output is not the true one"
    )
    reexec = t.executions - t.ranks
    boinc = 2 * t.ranks + t.third
    print(
        f"executions: {t.executions} for {t.ranks} ranks ({t.executions / t.ranks:.2f} per rank, "
        f"{reexec / t.jobs:.2f} re-executions per job, {t.third} third executions); "
        f"BOINC-style replication, every rank twice (a third time on a disagreement): {boinc} "
        f"({boinc / t.ranks:.2f} per rank, {(boinc - t.ranks) / t.jobs:.2f} per job): "
        f"{t.executions / boinc:.2f}x its executions"
    )
    print(
        f"hostile forgeries of originals: {t.forged}, of which {t.caught} caught and "
        f"{t.missed} in a job's result ({_frac(t.missed, t.forged)} of them); its forged "
        f"re-executions: {t.lies}, {t.lies_outvoted} outvoted"
    )
    return {
        "windows": [w.__dict__ for w in windows],
        "total": t.__dict__,
        "executions_per_rank": t.executions / t.ranks,
        "boinc_executions_per_rank": boinc / t.ranks,
        "missed_fraction": t.missed / t.forged if t.forged else None,
    }


# -- main -------------------------------------------------------------------------------------


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller heat run, one repetition")
    ap.add_argument("--repeat", type=int, default=0, help="plain/validated pairs (default 3)")
    ap.add_argument("--steps", type=int, default=0, help="heat steps (default 1000; quick 300)")
    ap.add_argument("--cells", type=int, default=0, help="cells per rank (200000; quick 50000)")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--jobs", type=int, default=400, help="simulated validated jobs")
    ap.add_argument("--window", type=int, default=50, help="jobs per row of the simulation")
    ap.add_argument("--honest", type=int, default=8, help="honest simulated agents")
    ap.add_argument("--forge", type=float, default=0.2, help="the hostile agent's forgery rate")
    ap.add_argument("--trusted-after", type=int, default=10)
    ap.add_argument("--min-rate", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", choices=["pool", "sampling"], default="")
    ap.add_argument("--json", default="", help="also write every run and the figures here")
    opts = ap.parse_args()
    opts.repeat = opts.repeat or (1 if opts.quick else 3)
    opts.steps = opts.steps or (300 if opts.quick else 1000)
    opts.cells = opts.cells or (50_000 if opts.quick else 200_000)
    if opts.repeat < 1 or opts.jobs < 1 or opts.window < 1 or opts.honest < 2:
        ap.error("need --repeat, --jobs, --window >= 1 and --honest >= 2")
    print(f"command: .venv/bin/python benchmarks/validation_costs.py {shlex.join(sys.argv[1:])}")
    load = os.getloadavg()
    print(
        f"machine: {os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f} at the start, Python {sys.version.split()[0]}"
    )
    out: dict[str, Any] = {"argv": sys.argv[1:], "cores": os.cpu_count()}
    if opts.only in ("", "pool"):
        t0 = time.monotonic()
        runs = measure_pool(opts)
        out["pool"] = {"runs": runs, "figures": report_pool(opts, runs)}
        print(f"(part 1 took {time.monotonic() - t0:.0f} s)")
    if opts.only in ("", "sampling"):
        t0 = time.monotonic()
        windows = trio.run(simulate, opts)
        out["sampling"] = report_sampling(opts, windows, time.monotonic() - t0)
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if opts.json:
        Path(opts.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    stop_cleanly_on_sigterm()
    sys.exit(main())
