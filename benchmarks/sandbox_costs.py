"""What the rank sandbox costs: rank start, checkpoint and restore, and a whole job.

    .venv/bin/python benchmarks/sandbox_costs.py [--starts N] [--dumps N] [--mb MB]
        [--steps S] [--ranks R] [--repeat K] [--json FILE]

Every figure is a pair measured in this one invocation, without and with the sandbox, and
their ratio (issue 16):

1. rank start: the agent's own code (``sandboxed.start`` with the agent's settings: cgroup,
   bwrap, seccomp filter, ``sandbox_init``; or a plain ``open_process``), from the call to
   the program's first line on its stdout, ``--starts`` times (median); the program imports
   nothing (``python -I -S``), so the figure is the launch alone;
2. checkpoint and restore: a process holding ``--mb`` MB forks a clone as a rank does; CRIU
   dumps the clone (inside the sandbox's namespaces, or from the host) and restores it (into
   a new sandbox by ``restore_init``, or under ``unshare`` as an unsandboxed restore does),
   until the restored clone has run; ``--dumps`` times (medians);
3. a job: ``examples/heat.py`` (``--steps``, ``--ranks``) on a local pool (2 agents, 1 relay),
   its agents with ``sandbox = "off"`` and with the default, ``--repeat`` times each,
   alternating (off, on, on, off, ...) so that drift hits both alike; the job's wall time
   from the coordinator (``finished - started``), medians and their ratio. The outputs of
   all runs must be the same (checked). The goal: under 2% (ratio < 1.02).

Needs root, bubblewrap and CRIU (``packaging/install-criu``) for parts 1-2; part 3 needs the
venv's ``vsdk``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio
from chaos import Pool, stop_cleanly_on_sigterm, wait_job

from vpool.worker_agent import criu, sandbox, sandboxed
from vpool.worker_agent.settings import AgentSettings

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PROBE = HERE / "programs" / "clone_probe.py"
PYTHON = sys.executable


def ratio(off: float, on: float) -> float:
    return on / off if off else float("nan")


# -- 1, 2: the agent's own code, no pool ------------------------------------------------------


class Bench:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.settings = AgentSettings(work_dir=str(root / "work"), identity_dir=str(root / "id"))
        self.iso = sandboxed.find_isolation(self.settings)
        if not self.iso.on:
            raise SystemExit(f"no sandbox here: {self.iso.reason}")
        self.limits = sandboxed.rank_limits(self.settings)
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.bind(str(root / "agent.sock"))
        self.sock.listen()
        self.n = 0

    def rank_dir(self) -> Path:
        self.n += 1
        d = self.root / f"rank-{self.n}"
        (d / "work").mkdir(parents=True)
        (d / "home").mkdir()
        shutil.copy(PROBE, d / "work" / "probe.py")
        return d

    async def start(self, boxed: bool, program: list[str], rank_dir: Path):
        if boxed:
            return await sandboxed.start(
                self.iso,
                sandbox.Mounts(rank_dir, self.root / "agent.sock"),
                lambda fd: sandbox.init_argv(
                    PYTHON,
                    program,
                    status_fd=fd,
                    linger=0,
                    stdin=False,
                    nofile=self.limits.open_files,
                    fsize=self.limits.disk,
                    sched_idle=self.limits.sched_idle,
                ),
                name=f"bench-{os.getpid()}-{self.n}",
                limits=self.limits,
                env={"PATH": os.environ.get("PATH", "")},
                cwd=rank_dir / "work",
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
        return await trio.lowlevel.open_process(
            program,
            cwd=rank_dir / "work",
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            process_group=0,
        )

    async def stop(self, started) -> None:
        if isinstance(started, sandboxed.Sandboxed):
            await started.aclose()
        else:
            os.killpg(started.pid, signal.SIGKILL)
            await started.wait()

    async def first_line(self, started) -> bytes:
        proc = started.process if isinstance(started, sandboxed.Sandboxed) else started
        line = b""
        while b"\n" not in line:
            chunk = await proc.stdout.receive_some(4096)
            if not chunk:
                raise RuntimeError(f"the program ended before its first line: {line!r}")
            line += chunk
        return line.split(b"\n")[0]

    async def start_time(self, boxed: bool) -> float:
        d = self.rank_dir()
        program = [PYTHON, "-I", "-S", "-c", "print('up', flush=True)"]
        t0 = time.perf_counter()
        started = await self.start(boxed, program, d)
        await self.first_line(started)
        took = time.perf_counter() - t0
        await self.stop(started)
        return took

    async def checkpoint(self, boxed: bool, mb: int) -> tuple[float, float]:
        d = self.rank_dir()
        out = f"{sandbox.RANK_DIR}/restored.txt" if boxed else str(d / "restored.txt")
        work = f"{sandbox.RANK_DIR}/work" if boxed else str(d / "work")
        started = await self.start(boxed, [PYTHON, "-I", "-S", f"{work}/probe.py", out, str(mb)], d)
        clone = int(await self.first_line(started))
        scratch = d / "ckpt"
        (scratch / "images").mkdir(parents=True)
        crit = self.settings.criu
        t0 = time.perf_counter()
        if boxed:
            await criu.dump(
                clone, scratch / "images", criu=crit, log_dir=scratch, enter=started.init_pid
            )
        else:
            await criu.dump(clone, scratch / "images", criu=crit, log_dir=scratch)
        dump = time.perf_counter() - t0
        await self.stop(started)
        t0 = time.perf_counter()
        with open(scratch / "restore.log", "wb") as log:  # noqa: ASYNC230 - an fd
            if boxed:
                restored = await sandboxed.start_restore(
                    self.iso,
                    sandbox.Mounts(d, self.root / "agent.sock"),
                    scratch,
                    python=PYTHON,
                    criu=crit,
                    name=f"bench-r-{os.getpid()}-{self.n}",
                    limits=self.limits,
                    log=log.fileno(),
                )
                await restored.process.wait()
                await restored.aclose()
            else:
                argv = criu.restore_command(scratch / "images", scratch / "status", criu=crit)
                proc = await trio.lowlevel.open_process(
                    argv,
                    cwd=d / "work",
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    process_group=0,
                )
                await proc.wait()
        restore = time.perf_counter() - t0
        text = (d / "restored.txt").read_text() if (d / "restored.txt").exists() else ""
        if not text.startswith("restored"):
            raise RuntimeError(
                f"the clone was not restored ({'sandboxed' if boxed else 'plain'}): "
                f"{(scratch / 'restore.log').read_text(errors='replace')[-800:]}"
            )
        return dump, restore


async def micro(opts: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="vpool-sandbox-bench-") as tmp:
        bench = Bench(Path(tmp))
        starts: dict[str, list[float]] = {"off": [], "on": []}
        for i in range(opts.starts):
            for boxed in (False, True) if i % 2 == 0 else (True, False):
                starts["on" if boxed else "off"].append(await bench.start_time(boxed))
        dumps: dict[str, list[float]] = {"off": [], "on": []}
        restores: dict[str, list[float]] = {"off": [], "on": []}
        for i in range(opts.dumps):
            for boxed in (False, True) if i % 2 == 0 else (True, False):
                dump, restore = await bench.checkpoint(boxed, opts.mb)
                dumps["on" if boxed else "off"].append(dump)
                restores["on" if boxed else "off"].append(restore)
        bench.sock.close()
    return {"start": starts, "dump": dumps, "restore": restores}


# -- 3: a job on a local pool -----------------------------------------------------------------


def set_sandbox(pool: Pool, home: Path, value: str | None) -> None:
    """Every agent's ``sandbox`` setting (None: the default), each agent restarted."""
    for config in sorted((home / "state" / "local-pool").glob("agent-*/config.toml")):
        lines = [ln for ln in config.read_text().splitlines(True) if not ln.startswith("sandbox")]
        if value is not None:
            lines.append(f'sandbox = "{value}"\n')
        config.write_text("".join(lines))
        name = config.parent.name
        pid = pool.processes().get(name)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 60
            while name in pool.processes():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not stop")
                time.sleep(0.2)
        pool.vsdk("local", "restart", name, timeout=120)


def job(pool: Pool, opts: argparse.Namespace, boxed: bool) -> tuple[float, bytes]:
    flags = [] if boxed else ["--allow-unsandboxed"]
    out = pool.vsdk(
        "submit",
        str(REPO / "examples" / "heat.py"),
        "--ranks",
        str(opts.ranks),
        *flags,
        "--json",
        "--",
        str(opts.steps),
    )
    job_id = int(json.loads(out)["id"])
    state, detail = wait_job(pool, job_id, 3600)
    if state != "succeeded":
        raise RuntimeError(f"heat.py {state}: {detail.get('job')}")
    info = detail["job"]
    return info["finished"] - info["started"], pool.vsdk("logs", str(job_id)).encode()


def jobs(opts: argparse.Namespace) -> dict:
    home = Path(tempfile.mkdtemp(prefix="vpool-sandbox-bench-pool-"))
    env = {**os.environ, "VPOOL_HOME": str(home)}
    pool = Pool(str(home), env)
    walls: dict[str, list[float]] = {"off": [], "on": []}
    outputs = set()
    try:
        pool.vsdk("local", "up", "--agents", "2", "--relays", "1", timeout=180)
        for i in range(opts.repeat):
            for boxed in (False, True) if i % 2 == 0 else (True, False):
                set_sandbox(pool, home, None if boxed else "off")
                wall, output = job(pool, opts, boxed)
                walls["on" if boxed else "off"].append(wall)
                outputs.add(output)
                print(
                    f"  heat.py {'sandboxed' if boxed else 'unsandboxed'}: {wall:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        pool.vsdk("local", "down", timeout=120, check=False)
        shutil.rmtree(home, ignore_errors=True)
    if len(outputs) != 1:
        raise RuntimeError("the runs printed different outputs")
    return {"job_wall": walls}


def report(figures: dict) -> None:
    labels = {
        "start": "rank start (s)",
        "dump": "checkpoint dump (s)",
        "restore": "restore (s)",
        "job_wall": "heat.py job wall (s)",
    }
    for key, label in labels.items():
        if key not in figures:
            continue
        off, on = (statistics.median(figures[key][k]) for k in ("off", "on"))
        print(
            f"{label:<24} without {off:8.4f}   with {on:8.4f}   ratio {ratio(off, on):.3f}"
            f"   (medians of {len(figures[key]['on'])})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=20)
    parser.add_argument("--dumps", type=int, default=5)
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-jobs", action="store_true", help="parts 1 and 2 only")
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args()
    stop_cleanly_on_sigterm()
    os.environ["PATH"] = "/usr/local/sbin:" + os.environ.get("PATH", "")
    figures = trio.run(micro, opts)
    if not opts.no_jobs:
        figures.update(jobs(opts))
    report(figures)
    if opts.json:
        opts.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
