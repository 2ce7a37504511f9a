"""What yielding to the machine's owner costs (issue 22): owner back -> the ranks use no CPU,
machine going to sleep -> every rank's image committed.

    .venv/bin/python benchmarks/suspend_costs.py [--quick] [--repeat N] [--fast-interval S]
                                                 [--json FILE] [--logs DIR]

A local pool (``vsdk local up --agents 1 --relays 1 --slots 4`` in a temporary VPOOL_HOME,
stopped at the end whatever happens, Ctrl-C included) whose one agent is pointed at a fake
logind (``tests/worker_agent/fake_logind.py``: a real ``dbus-daemon`` and the fake served by
this process) with ``run_when = "idle"``, ``idle_after = 1`` (with 0 the agent never suspends:
logind's "not idle" is 0 s of idleness, not less than 0) and ``idle_source = "logind"``. The
agent runs all four ranks of benchmarks/programs/busy.py (a pure-Python compute loop with an
``allreduce`` every few tens of milliseconds). ``--repeat`` times each (default 5, ``--quick``
2), every figure against a baseline measured in the same invocation:

1. **Owner back.** After a random wait (so that the moment falls anywhere in the agent's
   period), the fake's IdleHint goes false at t0; t1 is the first look (every 2 ms) at which
   every rank's freezer cgroup says FROZEN and the CPU time of every task in the four groups
   (``/proc/TID/schedstat``, nanoseconds; ``/proc/PID/stat``'s utime + stime count 10 ms
   ticks) has not grown 20 ms later. Reported: t1 - t0, and its two parts: until the agent's
   next look (the first ``Get(IdleHint)`` the fake answers after t0) and from that look to t1.
   After another random wait IdleHint goes true (idle for an hour): the time until every
   group says THAWED. Baseline: this process freezes (then thaws) the same four groups
   itself, writing ``freezer.state``, timed the same way: the kernel's floor. (Not looked at
   in a busy loop: a frozen task must run to stop, and the ranks run at SCHED_IDLE, so a
   spinning benchmark makes the freeze slower.) The agent looks every
   ``manners_interval`` (its default, then ``--fast-interval``, 0.25 s, after a restart of the
   agent with that setting and a new job; 0 skips it), so an owner's return waits U(0,
   interval) for the next look, interval / 2 on average.
2. **Going to sleep.** PrepareForSleep(true) at t0: t_commit is when the last of the four ranks
   has a checkpoint newer than before committed on the relay's disk (its manifest
   ``<ckpt>.json``, the commit point, looked for every 2 ms); t_release when the fake sees the
   agent's delay inhibitor lock closed. At the release the images on disk are checked: every
   rank's must be committed (the lock goes only after the commit); the coordinator's
   ``rank_lost`` events say which losses it recorded only after the release (on a real
   machine, asleep by then). Then PrepareForSleep(false): the agent takes a lock again, the
   coordinator restarts the four ranks (handed back as lost) and this, the only agent,
   restores them; "woke -> running" is until every rank runs again, and each must have been
   restored from the image taken for the sleep (its ``rank_restored`` event). Baseline: a
   checkpoint order of every rank (``vsdk checkpoint JOB``'s call, made in-process with the
   pool's client: a vsdk process would add its own start-up), until four new images are
   committed; the sleep signal comes ``SPACING`` (1 s) after those commits (sooner, a rank
   whose checkpoint the agent has not seen end yet is handed back with that image, no new
   one).

Prints a table (what, median, max, baseline median, ratio) and one JSON line of the figures;
``--json FILE`` also writes every measurement, ``--logs DIR`` keeps the pool's logs. Every
wait has a deadline; the job is cancelled at the end (its steps also bound it).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from chaos import TERMINAL, Pool, job_state, rank_processes
from jeepney import HeaderFields  # type: ignore[import-untyped]

from vpool.worker_agent.settings import AgentSettings

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent))  # the fake logind of the tests
from tests.worker_agent.fake_logind import (  # noqa: E402
    MANAGER,
    PROPERTIES,
    FakeLogind,
    start_dbus_daemon,
)

PROGRAM = str(HERE / "programs" / "busy.py")
AGENT = "agent-0"
RANKS = 4
IDLE_AFTER = 1.0  # s; the agent's idle_after
AWAY = 3600.0  # s the owner has been away when the benchmark says "idle"
POLL = 0.002  # s between two looks at the freezer states or the relay's disk
CPU_GAP = 0.02  # s between the two CPU samples that say "no CPU"
LIMIT = 30.0  # s for a freeze, a thaw, a sleep's images
SPACING = 1.0  # s between a checkpoint order's commits and the next sleep signal
START_LIMIT = 120.0  # s for a job's ranks to run (again)
TICK = os.sysconf("SC_CLK_TCK")


def say(*args: object) -> None:
    print(*args, flush=True)


# -- the ranks' cgroups -----------------------------------------------------------------------


def freezer_dir(pid: int) -> Path:
    """The freezer cgroup (v1) of process ``pid``."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "freezer" in controllers.split(","):
            if path in ("", "/"):
                break
            return Path("/sys/fs/cgroup/freezer") / path.lstrip("/")
    raise RuntimeError(f"process {pid} has no freezer cgroup of its own (cgroup v1 needed)")


class Groups:
    """The freezer cgroups of the ranks (one each)."""

    def __init__(self, dirs: list[Path]) -> None:
        self.dirs = dirs

    def states(self) -> list[str]:
        out = []
        for d in self.dirs:
            try:
                out.append((d / "freezer.state").read_text().strip())
            except OSError:
                out.append("GONE")
        return out

    def cpu_ns(self) -> list[int]:
        """CPU time of every task of each group, in nanoseconds (``schedstat``)."""
        out = []
        for d in self.dirs:
            total = 0
            try:
                tids = (d / "tasks").read_text().split()
            except OSError:
                tids = []
            for tid in tids:
                try:
                    with open(f"/proc/{tid}/schedstat") as f:
                        total += int(f.read().split()[0])
                except (OSError, ValueError, IndexError):
                    continue  # gone meanwhile
            out.append(total)
        return out

    def write(self, state: str) -> None:
        for d in self.dirs:
            (d / "freezer.state").write_text(state)


async def wait_no_cpu(groups: Groups, deadline: float) -> float:
    """The first moment every group is FROZEN and its CPU time stays still for ``CPU_GAP``."""
    while True:
        seen = time.monotonic()
        if all(s == "FROZEN" for s in groups.states()):
            cpu = groups.cpu_ns()
            await trio.sleep(CPU_GAP)
            if groups.cpu_ns() == cpu and all(s == "FROZEN" for s in groups.states()):
                return seen
        if seen > deadline:
            raise RuntimeError(f"the ranks did not stop in time: {groups.states()}")
        await trio.sleep(POLL)


async def wait_thawed(groups: Groups, deadline: float) -> float:
    while True:
        seen = time.monotonic()
        if all(s == "THAWED" for s in groups.states()):
            return seen
        if seen > deadline:
            raise RuntimeError(f"the ranks were not thawed in time: {groups.states()}")
        await trio.sleep(POLL)


async def wait_running_cpu(groups: Groups, ms: float, limit: float = LIMIT) -> None:
    """Until every group has used ``ms`` milliseconds of CPU more than now (they run)."""
    start = groups.cpu_ns()
    deadline = time.monotonic() + limit
    while any(c - s < ms * 1e6 for c, s in zip(groups.cpu_ns(), start, strict=True)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the ranks use no CPU after {limit:g} s: {groups.states()}")
        await trio.sleep(0.01)


# -- the relay's disk -------------------------------------------------------------------------


def newest_committed(home: Path, job: int, rank: int) -> int:
    """The newest checkpoint of ``rank`` committed on a relay's disk (its manifest), 0: none."""
    best = 0
    for d in (home / "state" / "local-pool").glob(f"relay-*/data/jobs/{job}/{rank}/ckpt"):
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            stem, dot, ext = name.partition(".")
            if dot and ext == "json" and stem.isdigit():
                best = max(best, int(stem))
    return best


async def wait_commits(
    home: Path, job: int, before: dict[int, int], deadline: float
) -> dict[int, tuple[float, int]]:
    """When (and which) a checkpoint newer than ``before`` was first seen committed, per rank."""
    seen: dict[int, tuple[float, int]] = {}
    while len(seen) < len(before):
        now = time.monotonic()
        for rank, old in before.items():
            if rank not in seen and (new := newest_committed(home, job, rank)) > old:
                seen[rank] = (now, new)
        if len(seen) < len(before):
            if now > deadline:
                missing = sorted(set(before) - set(seen))
                raise RuntimeError(f"no new image committed for rank(s) {missing} in time")
            await trio.sleep(POLL)
    return seen


# -- the pool ---------------------------------------------------------------------------------


class TimedLogind(FakeLogind):
    """The fake logind, noting when it answers each ``Get(IdleHint)`` (an agent's look)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.looks: list[float] = []

    async def _handle(self, message: Any) -> None:
        fields = message.header.fields
        if (
            fields.get(HeaderFields.member) == "Get"
            and fields.get(HeaderFields.interface) == PROPERTIES
            and tuple(message.body) == (MANAGER, "IdleHint")
        ):
            self.looks.append(time.monotonic())
        await super()._handle(message)


class Bench:
    def __init__(self, opts: argparse.Namespace, home: Path, fake: TimedLogind) -> None:
        self.opts = opts
        self.home = home
        self.fake = fake
        env = {
            **os.environ,
            "VPOOL_HOME": str(home),
            "PATH": "/usr/local/sbin:" + os.environ.get("PATH", "/usr/bin:/bin"),  # CRIU
        }
        self.pool = Pool(str(home), env)
        self.rng = random.Random(opts.seed)
        self.frozen_by_us: list[Groups] = []  # thawed again whatever happens
        self.runs: dict[str, Any] = {}

    def local_pool(self) -> Path:
        return self.home / "state" / "local-pool"

    def agent_pid(self) -> int:
        listed = json.loads((self.local_pool() / "pids.json").read_text())
        return next(int(p["pid"]) for p in listed if p["name"] == AGENT)

    async def vsdk(self, *args: str) -> str:
        """``vsdk ARGS`` (at most 120 s; a cancel waits for it: no pool half up)."""
        return await trio.to_thread.run_sync(lambda: self.pool.vsdk(*args, timeout=120))

    async def reconfigure(self, **settings: object) -> None:
        """Restart the agent with ``settings`` in its config file (SIGKILL by pid, then
        ``vsdk local restart``), and wait until it holds its delay lock at the fake logind."""
        path = self.local_pool() / AGENT / "config.toml"
        kept = [ln for ln in path.read_text().splitlines() if ln.split(" ")[0] not in settings]
        added = [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
        path.write_text("\n".join([*kept, *added, ""]))
        exited = os.pidfd_open(self.agent_pid())  # readable once the agent has exited
        try:
            signal.pidfd_send_signal(exited, signal.SIGKILL)
            ready = await trio.to_thread.run_sync(lambda: select.select([exited], [], [], 30)[0])
            if not ready:
                raise RuntimeError(f"{AGENT} still runs 30 s after SIGKILL")
        finally:
            os.close(exited)
        self.keep_logs(f"before-restart-{len(self.runs)}")  # a restart starts its log anew
        await self.vsdk("local", "restart", AGENT)
        await self.fake.wait_for(lambda: self.fake.held("delay", "sleep"), seconds=30)

    async def submit(self) -> int:
        out = await self.vsdk(
            "submit", PROGRAM, "--ranks", str(RANKS), "--json", "--", str(self.opts.steps)
        )
        return int(json.loads(out)["id"])

    async def ranks_running(self, job: int, old: set[int]) -> dict[int, int]:
        """Every rank of ``job`` running (coordinator) and its process found under the agent,
        none of them one of ``old``: MPI rank -> pid."""
        deadline = time.monotonic() + START_LIMIT
        agents = {AGENT: self.agent_pid()}
        while True:
            d = await trio.to_thread.run_sync(job_state, self.pool, job)
            if d is not None and d["job"]["state"] in TERMINAL:
                raise RuntimeError(f"job {job} ended: {json.dumps(d)[-2000:]}")
            if d is not None and all(r["state"] == "running" for r in d["ranks"]):
                found = await trio.to_thread.run_sync(rank_processes, agents, PROGRAM, job)
                pids: dict[int, list[int]] = {}
                for _, pid, rank in found:
                    pids.setdefault(rank, []).append(pid)
                if sorted(pids) == list(range(RANKS)) and all(
                    len(p) == 1 and p[0] not in old for p in pids.values()
                ):
                    return {rank: p[0] for rank, p in sorted(pids.items())}
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job}: its ranks do not all run after {START_LIMIT} s")
            await trio.sleep(0.1)

    async def groups_of(
        self, job: int, old: frozenset[int] | set[int] = frozenset()
    ) -> tuple[Groups, set[int], float]:
        """The ranks' freezer groups once they run and compute, their pids, and when they
        were first seen running."""
        pids = await self.ranks_running(job, set(old))
        found = time.monotonic()
        groups = Groups([freezer_dir(pid) for pid in pids.values()])
        if len(set(groups.dirs)) != RANKS:
            raise RuntimeError(f"the ranks share freezer cgroups: {groups.dirs}")
        await wait_running_cpu(groups, 100)  # started (MPI initialized) and computing
        return groups, set(pids.values()), found

    async def cancel(self, job: int) -> None:
        await self.vsdk("cancel", str(job))
        agents = {AGENT: self.agent_pid()}
        deadline = time.monotonic() + LIMIT
        while await trio.to_thread.run_sync(rank_processes, agents, PROGRAM, job):
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job}'s rank processes still run {LIMIT:g} s after")
            await trio.sleep(0.1)

    # -- 1. owner back --------------------------------------------------------------------

    async def owner_back(self, groups: Groups, interval: float) -> dict[str, float]:
        await trio.sleep(self.rng.uniform(0, interval))
        fake = self.fake
        looks = len(fake.looks)
        t0 = time.monotonic()
        fake.set_idle(False)
        stopped = await wait_no_cpu(groups, t0 + LIMIT)
        look = next((t for t in fake.looks[looks:] if t >= t0), stopped)
        await trio.sleep(self.rng.uniform(0, interval))  # not in step with the agent's looks
        t2 = time.monotonic()
        fake.set_idle(True, since=AWAY)
        thawed = await wait_thawed(groups, t2 + LIMIT)
        await wait_running_cpu(groups, 20)
        return {"stopped": stopped - t0, "look": look - t0, "thawed": thawed - t2}

    async def kernel_freeze(self, groups: Groups) -> dict[str, float]:
        self.frozen_by_us.append(groups)
        t0 = time.monotonic()
        groups.write("FROZEN")
        stopped = await wait_no_cpu(groups, t0 + LIMIT)
        t2 = time.monotonic()
        groups.write("THAWED")
        thawed = await wait_thawed(groups, t2 + LIMIT)
        self.frozen_by_us.remove(groups)
        await wait_running_cpu(groups, 20)
        return {"stopped": stopped - t0, "thawed": thawed - t2}

    async def owner_rounds(self, job: int, interval: float, key: str) -> set[int]:
        groups, pids, _ = await self.groups_of(job)
        agent, kernel = [], []
        for i in range(self.opts.repeat):
            kernel.append(await self.kernel_freeze(groups))
            agent.append(await self.owner_back(groups, interval))
            a, k = agent[-1], kernel[-1]
            say(
                f"  [{key}] #{i}: owner back -> no CPU {a['stopped']:.3f} s (look after "
                f"{a['look']:.3f} s), thawed {a['thawed']:.3f} s; kernel {k['stopped'] * 1e3:.2f}"
                f" ms, thaw {k['thawed'] * 1e3:.2f} ms"
            )
        self.runs[key] = {"interval": interval, "agent": agent, "kernel": kernel}
        return pids

    # -- 2. going to sleep ----------------------------------------------------------------

    def committed(self, job: int) -> dict[int, int]:
        return {rank: newest_committed(self.home, job, rank) for rank in range(RANKS)}

    def agent_cpu(self) -> float:
        """CPU seconds the agent process used so far (utime + stime, 10 ms ticks)."""
        with open(f"/proc/{self.agent_pid()}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICK

    async def ordered(self, job: int) -> dict[str, float]:
        before = self.committed(job)
        client = self.pool.client()
        looks, cpu = len(self.fake.looks), self.agent_cpu()
        t0 = time.monotonic()
        await trio.to_thread.run_sync(client.checkpoint, job)
        commits = await wait_commits(self.home, job, before, t0 + LIMIT)
        return {
            "committed": max(t for t, _ in commits.values()) - t0,
            "looks": len(self.fake.looks) - looks,
            "agent_cpu": self.agent_cpu() - cpu,
        }

    async def sleep_and_wake(self, job: int, old: set[int]) -> tuple[dict[str, Any], set[int]]:
        fake = self.fake
        (lock,) = fake.held("delay", "sleep")
        before = self.committed(job)
        at_release: dict[str, Any] = {}
        looks, cpu = len(fake.looks), self.agent_cpu()

        async def watch_release() -> None:
            await lock.released.wait()
            at_release["t"] = time.monotonic()
            at_release["wall"] = time.time()
            at_release["committed"] = self.committed(job)
            at_release["looks"] = len(fake.looks) - looks
            at_release["agent_cpu"] = self.agent_cpu() - cpu

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_release)
            t0, t0_wall = time.monotonic(), time.time()
            await fake.prepare_for_sleep(True)
            commits = await wait_commits(self.home, job, before, t0 + LIMIT)
            await fake.wait_released(lock, seconds=LIMIT)
        t_commit = max(t for t, _ in commits.values())
        images = {rank: ckpt for rank, (_, ckpt) in commits.items()}
        in_order = all(at_release["committed"][r] >= images[r] for r in range(RANKS))

        t_wake = time.monotonic()
        await fake.prepare_for_sleep(False)
        await fake.wait_for(lambda: fake.held("delay", "sleep"), seconds=LIMIT)
        _, pids, running = await self.groups_of(job, old)
        d = await trio.to_thread.run_sync(job_state, self.pool, job)
        events = (d or {}).get("events", [])
        restored, late = 0, []
        for rank in range(RANKS):
            got = [e for e in events if e["kind"] == "rank_restored" and e["rank"] == rank]
            if got and str(images[rank]) in got[-1]["message"]:
                restored += 1
            lost = [
                e["time"]
                for e in events
                if e["kind"] == "rank_lost" and e["rank"] == rank and e["time"] >= t0_wall
            ]
            if lost and lost[0] > at_release["wall"]:
                late.append(lost[0] - at_release["wall"])
        return {
            "committed": t_commit - t0,
            "released": at_release["t"] - t0,
            "released_after_commit": in_order,
            # The agent's passes (each a look at logind) and CPU from the signal to the release.
            "looks": at_release["looks"],
            "agent_cpu": at_release["agent_cpu"],
            "woke_to_running": running - t_wake,
            "restored_from_sleep_image": restored,
            # Ranks whose loss the coordinator recorded after the lock was released (a real
            # machine would be asleep by then), and by how much.
            "lost_after_release": late,
        }, pids

    async def sleep_rounds(self, job: int, pids: set[int]) -> set[int]:
        ordered, sleeps = [], []
        for i in range(self.opts.repeat):
            ordered.append(await self.ordered(job))
            # The agent ends a checkpoint once the relay acknowledged its commit; a sleep
            # signal before that would hand the rank back with that image (one in flight
            # counts): no new image to time.
            await trio.sleep(SPACING)
            s, pids = await self.sleep_and_wake(job, pids)
            sleeps.append(s)
            say(
                f"  [sleep] #{i}: ordered checkpoint {ordered[-1]['committed']:.3f} s; "
                f"going to sleep -> committed {s['committed']:.3f} s, lock released "
                f"{s['released']:.3f} s{'' if s['released_after_commit'] else ' (BEFORE!)'}; "
                f"woke -> running {s['woke_to_running']:.2f} s, restored from the sleep's "
                f"image {s['restored_from_sleep_image']}/{RANKS}; losses recorded after the "
                f"release: {len(s['lost_after_release'])}"
            )
        self.runs["sleep"] = {"ordered": ordered, "sleep": sleeps}
        return pids

    # -- the whole ------------------------------------------------------------------------

    async def run(self) -> None:
        opts = self.opts
        default = AgentSettings().manners_interval
        say(f"pool: 1 agent x 4 slots, 1 relay; agent manners_interval {default:g} s (default)")
        await self.vsdk(
            "local", "up", "--agents", "1", "--relays", "1", "--slots", str(RANKS), "--quiet"
        )
        common = {
            "logind_bus": self.fake.address,
            "idle_source": "logind",
            "run_when": "idle",
            "idle_after": IDLE_AFTER,
        }
        await self.reconfigure(**common)
        job = await self.submit()
        say(f"job {job}: {RANKS} ranks of {Path(PROGRAM).name}")
        pids = await self.owner_rounds(job, default, "default")
        await self.sleep_rounds(job, pids)
        await self.cancel(job)
        if opts.fast_interval > 0:
            say(f"agent restarted with manners_interval {opts.fast_interval:g} s")
            await self.reconfigure(**common, manners_interval=opts.fast_interval)
            job = await self.submit()
            say(f"job {job}: {RANKS} ranks of {Path(PROGRAM).name}")
            await self.owner_rounds(job, opts.fast_interval, "fast")
            await self.cancel(job)

    def keep_logs(self, tag: str) -> None:
        """Copy the pool's logs to ``--logs`` (``NAME.TAG.log``), if given."""
        if not self.opts.logs:
            return
        Path(self.opts.logs).mkdir(parents=True, exist_ok=True)
        for log in (self.local_pool() / "logs").glob("*.log"):
            shutil.copyfile(log, Path(self.opts.logs) / f"{log.stem}.{tag}.log")

    def print_logs(self, chars: int = 6000) -> None:
        """The end of every component's log, on stderr (for a failed run)."""
        for log in sorted((self.local_pool() / "logs").glob("*.log")):
            text = log.read_text(errors="replace")[-chars:]
            print(f"----- {log.name}\n{text}", file=sys.stderr, flush=True)

    def cleanup_now(self) -> None:
        for groups in self.frozen_by_us:
            try:
                groups.write("THAWED")
            except OSError:
                pass
        self.frozen_by_us.clear()


# -- the report -------------------------------------------------------------------------------


def _stats(values: list[float]) -> tuple[float, float]:
    return statistics.median(values), max(values)


def report(runs: dict[str, Any]) -> dict[str, Any]:
    rows: list[tuple[str, float, float, float | None, str]] = []
    figures: dict[str, Any] = {}

    def row(what: str, values: list[float], base: list[float] | None, label: str = "") -> None:
        med, top = _stats(values)
        b = statistics.median(base) if base else None
        rows.append((what, med, top, b, label))
        figures[what] = {"median_s": med, "max_s": top, "n": len(values)}
        if b is not None:
            figures[what].update(baseline_median_s=b, ratio=med / b, baseline=label)

    notes = []
    for key in ("default", "fast"):
        if key not in runs:
            continue
        r = runs[key]
        iv, agent, kernel = r["interval"], r["agent"], r["kernel"]
        tag = f"(manners_interval {iv:g} s)"
        row(
            f"owner back -> ranks use no CPU {tag}",
            [a["stopped"] for a in agent],
            [k["stopped"] for k in kernel],
            "kernel freeze",
        )
        row(f"  of it: until the agent's next look {tag}", [a["look"] for a in agent], None)
        row(
            f"  of it: from that look to no CPU {tag}",
            [a["stopped"] - a["look"] for a in agent],
            [k["stopped"] for k in kernel],
            "kernel freeze",
        )
        row(
            f"owner away again -> ranks thawed {tag}",
            [a["thawed"] for a in agent],
            [k["thawed"] for k in kernel],
            "kernel thaw",
        )
        looked = statistics.median(a["look"] for a in agent)
        total = statistics.median(a["stopped"] for a in agent)
        notes.append(
            f"manners_interval {iv:g} s: the owner's return waits U(0, {iv:g} s) for the next "
            f"look, {iv / 2:g} s on average; measured median {looked:.3f} s of the "
            f"{total:.3f} s ({looked / total:.0%})"
        )
        figures[f"manners_interval_{key}_s"] = iv
    if "sleep" in runs:
        ordered_runs = runs["sleep"]["ordered"]
        ordered = [o["committed"] for o in ordered_runs]
        sleeps = runs["sleep"]["sleep"]
        row(
            "going to sleep -> every image committed",
            [s["committed"] for s in sleeps],
            ordered,
            "vsdk checkpoint",
        )
        row(
            "going to sleep -> inhibitor lock released",
            [s["released"] for s in sleeps],
            ordered,
            "vsdk checkpoint",
        )
        row(
            "  of it: lock released after the last commit",
            [s["released"] - s["committed"] for s in sleeps],
            None,
        )
        row("woke -> every rank running again", [s["woke_to_running"] for s in sleeps], None)
        in_order = all(s["released_after_commit"] for s in sleeps)
        restored = [s["restored_from_sleep_image"] for s in sleeps]
        figures["lock_released_after_every_commit"] = in_order
        figures["ranks_restored_from_sleep_image"] = restored
        late = [x for s in sleeps for x in s["lost_after_release"]]
        figures["losses_recorded_after_release"] = [len(s["lost_after_release"]) for s in sleeps]
        figures["losses_recorded_after_release_max_s"] = max(late, default=0.0)
        notes.append(
            "every image committed before the lock was released: "
            + ("yes, every time" if in_order else "NO (see the runs)")
            + f"; ranks restored from the sleep's image: {restored} of {RANKS}"
        )
        spans = (
            ("hand_back", "the hand-back (sleep signal -> lock released)", sleeps, "released"),
            ("ordered", "an ordered checkpoint (order -> last commit)", ordered_runs, "committed"),
        )
        for key, label, measured, span in spans:
            n = statistics.median(r["looks"] for r in measured)
            cpu = statistics.median(r["agent_cpu"] for r in measured)
            per_s = statistics.median(r["looks"] / r[span] for r in measured)
            share = statistics.median(r["agent_cpu"] / r[span] for r in measured)
            figures[f"agent_during_{key}"] = {
                "looks": n,
                "looks_per_s": per_s,
                "cpu_s": cpu,
                "cpu_share": share,
            }
            notes.append(
                f"the agent during {label}: median {n:g} looks at logind ({per_s:.0f}/s), "
                f"{cpu:.2f} s of CPU ({share:.0%} of a core)"
            )
        notes.append(
            "rank losses the coordinator recorded only after the lock was released (when a "
            f"real machine sleeps): {figures['losses_recorded_after_release']} of {RANKS}"
            + (f", up to {max(late) * 1e3:.0f} ms after" if late else "")
        )
    width = max(len(r[0]) for r in rows)
    say(f"\n{'what':<{width}}  median s   max s  baseline s  ratio  baseline")
    for what, med, top, base, label in rows:
        b = f"{base:10.4f}  {med / base:5.1f}x  {label}" if base is not None else ""
        say(f"{what:<{width}}  {med:8.3f}  {top:6.3f}  {b}")
    for n in notes:
        say(n)
    return figures


# -- main -------------------------------------------------------------------------------------


async def bench(opts: argparse.Namespace, tmp: Path, stop: trio.CancelScope) -> dict[str, Any]:
    bus_dir = tmp / "bus"
    bus_dir.mkdir()
    fake = TimedLogind()
    fake.set_idle(True, since=AWAY)
    async with trio.open_nursery() as nursery:
        daemon = await start_dbus_daemon(bus_dir, nursery)
        with trio.fail_after(10):
            await nursery.start(fake.serve, daemon.address)
        b = Bench(opts, tmp / "home", fake)
        try:
            with stop:
                await b.run()
        except Exception:
            b.print_logs()
            raise
        finally:
            b.cleanup_now()
            b.keep_logs("end")
            with trio.move_on_after(180, shield=True):
                await trio.to_thread.run_sync(
                    lambda: b.pool.vsdk("local", "down", check=False, timeout=120)
                )
            nursery.cancel_scope.cancel()
    return b.runs


async def main_async(opts: argparse.Namespace, tmp: Path) -> tuple[dict[str, Any], int]:
    got: list[int] = []
    stop = trio.CancelScope()
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for signum in signals:  # later ones are ignored: the cleanup runs
                    got.append(signum)
                    stop.cancel()

            nursery.start_soon(watch)
            runs = await bench(opts, tmp, stop)
            nursery.cancel_scope.cancel()
    return runs, got[0] if got else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 repetitions")
    ap.add_argument("--repeat", type=int, default=0, help="repetitions of each (default 5)")
    ap.add_argument(
        "--fast-interval",
        type=float,
        default=0.25,
        help="second row: owner back with this manners_interval (0: skip)",
    )
    ap.add_argument("--steps", type=int, default=50_000, help="the program's bound")
    ap.add_argument("--seed", type=int, default=1, help="of the random waits")
    ap.add_argument("--json", default="", help="also write every measurement here")
    ap.add_argument("--logs", default="", help="copy the pool's logs to this directory")
    opts = ap.parse_args()
    opts.repeat = opts.repeat or (2 if opts.quick else 5)
    say(f"command: .venv/bin/python benchmarks/suspend_costs.py {shlex.join(sys.argv[1:])}")
    load = os.getloadavg()
    say(f"machine: {os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(
        prefix="vpool-suspend-bench-", ignore_cleanup_errors=True
    ) as tmp:
        runs, signum = trio.run(main_async, opts, Path(tmp))
    if signum:
        say(f"stopped by signal {signum}; the pool is down")
        return 128 + signum
    figures = report(runs)
    say(f"(took {time.monotonic() - t0:.0f} s)")
    print(json.dumps(figures), flush=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps({"runs": runs, "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
