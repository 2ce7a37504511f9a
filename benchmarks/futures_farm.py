"""A farm of small tasks with mpi4py.futures on the pool, against real MPI, and what losing a
worker every 10 s costs it (issue 23).

    .venv/bin/python benchmarks/futures_farm.py [--tasks 10000] [--workers 4] [--agents 2]
                                                [--loss-every 10] [--loss-seconds 60]
                                                [--repeat 1] [--json FILE]

benchmarks/programs/futures_tasks.py submits ``--tasks`` tasks of about 50 us each and waits
for all of them; it prints the tasks per second between its first submission and its last
result (the workers already started) and whether every task came back exactly once with its
value. In one invocation:

1. **MPICH** (the baseline): ``mpiexec -n W+1 python -m mpi4py.futures futures_tasks.py N``,
   with the real mpi4py on Debian's MPICH;
2. **vpool**: the same program and form on a local pool (``vsdk local up --agents A --relays
   1`` in a temporary VPOOL_HOME, stopped at the end), ``vsdk submit -m mpi4py.futures -n W+1
   --wait``; reported as tasks per second and as the ratio to MPICH's; then the same with
   ``--on-failure abort`` (no determinant logging: what the master's protection costs);
3. **one worker lost every ``--loss-every`` s**: the spawn form (``MPIPoolExecutor`` asks the
   pool for W workers, whose losses are reported to the master and whose in-flight tasks are
   re-dispatched), on enough tasks for the fault-free run to last about ``--loss-seconds``;
   first fault-free, then while this script SIGKILLs one worker process of the job (chosen at
   random, seeded) every ``--loss-every`` s. Reported: the slowdown (time with losses / time
   without), the workers lost, the tasks re-dispatched, and whether the result was right.
   When the pool cannot spawn (an older runtime), step 3 uses the ``-m mpi4py.futures`` form,
   whose workers are ranks of the job restarted by replay instead (the table says which).

Every wait has a deadline; jobs are cancelled at the end whatever happens.
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
import threading
import time
from pathlib import Path

from chaos import Pool, _cmdline, _descendants, _environ, _stdout, stop_cleanly_on_sigterm

HERE = Path(__file__).resolve().parent
PROGRAM = str(HERE / "programs" / "futures_tasks.py")
PYTHON = str(Path(sys.executable))


def mpich(tasks: int, workers: int) -> dict:
    """The baseline: real mpi4py on MPICH, ``-m mpi4py.futures``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cmd = ["mpiexec", "-n", str(workers + 1), PYTHON, "-m", "mpi4py.futures", PROGRAM, str(tasks)]
    out = subprocess.run(cmd, env=env, capture_output=True, timeout=600, check=True)
    return _report(out.stdout.decode())


def _report(stdout: str) -> dict:
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return dict(json.loads(line))
    raise RuntimeError(f"no report in the program's output: {stdout[-2000:]!r}")


def on_pool(
    pool: Pool, tasks: int, workers: int, form: str, killer=None, extra: tuple[str, ...] = ()
) -> dict:
    """One run on the pool (``form``: "module" or "spawn"); ``killer(job)`` runs alongside;
    ``extra``: more ``vsdk submit`` flags."""
    if form == "module":
        flags = ["-m", "mpi4py.futures", "--ranks", str(workers + 1)]
        args = [str(tasks)]
    else:
        flags = ["--ranks", "1", "--universe", str(workers + 1)]
        args = [str(tasks), "--spawn", str(workers)]
    cmd = ("submit", PROGRAM, *flags, *extra, "--json", "--", *args)
    job = int(json.loads(pool.vsdk(*cmd))["id"])
    stop = threading.Event()
    kills: list[float] = []
    thread = None
    if killer is not None:
        thread = threading.Thread(target=killer, args=(pool, job, stop, kills), daemon=True)
        thread.start()
    print(
        f"  job {job}: {form} form, {tasks} tasks{', killing' if killer else ''}", file=sys.stderr
    )
    try:
        out = pool.vsdk("logs", str(job), "--follow", timeout=900, check=False)
        state = json.loads(pool.vsdk("status", str(job), "--json"))
    finally:
        stop.set()
        if thread is not None:
            thread.join(30)
        pool.vsdk("cancel", str(job), check=False)
    if state["job"]["state"] != "succeeded":
        raise RuntimeError(f"job {job} ({form}) ended {state['job']['state']}: {state['job']}")
    report = _report(out)
    report["kills"] = len(kills)
    report["failed_ranks"] = len(state["job"].get("failed_ranks", []))
    report["restarts"] = state["job"].get("restarts", 0)
    return report


def workers_of(pool: Pool, job: int) -> list[int]:
    """Pids of the job's rank processes other than rank 0 (its workers), as this script sees
    them: Python processes under the pool's agents with the job's VPOOL_JOB, not a sandbox's
    wrapper (its parent is one of them) nor a checkpoint clone (stdout /dev/null)."""
    agents = {n: p for n, p in pool.processes().items() if n.startswith("agent-")}
    found: dict[int, int] = {}
    for root in agents.values():
        for pid, parent in _descendants(root):
            cmd = _cmdline(pid)
            if not cmd or not Path(cmd[0]).name.startswith("python"):
                continue
            env = _environ(pid)
            if env.get(b"VPOOL_JOB") != str(job).encode() or env.get(b"VPOOL_RANK") in (None, b"0"):
                continue
            found[pid] = parent
    return [
        pid for pid, parent in found.items() if parent not in found and _stdout(pid) != "/dev/null"
    ]


def killer_every(seconds: float, seed: int):
    rng = random.Random(seed)

    def kill_loop(pool: Pool, job: int, stop: threading.Event, kills: list[float]) -> None:
        while not stop.wait(seconds):
            victims = workers_of(pool, job)
            if not victims:
                continue
            try:
                os.kill(rng.choice(sorted(victims)), signal.SIGKILL)
                kills.append(time.time())
            except ProcessLookupError:
                pass

    return kill_loop


def can_spawn(pool: Pool, workers: int) -> bool:
    try:
        on_pool(pool, 200, workers, "spawn")
    except (RuntimeError, subprocess.SubprocessError) as exc:
        print(
            f"  the pool cannot run the spawn form ({exc}); losses use -m mpi4py.futures",
            file=sys.stderr,
        )
        return False
    return True


def median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tasks", type=int, default=10_000)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--loss-every", type=float, default=10.0)
    ap.add_argument("--loss-seconds", type=float, default=60.0)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--seed", type=int, default=23)
    ap.add_argument("--json", default="")
    opts = ap.parse_args()
    figures: dict = {"mpich": [], "vpool": [], "unlogged": [], "steady": [], "losses": []}
    for _ in range(opts.repeat):
        figures["mpich"].append(mpich(opts.tasks, opts.workers))
    with tempfile.TemporaryDirectory(prefix="vpool-farm-") as home:
        pool = Pool(home, {**os.environ, "VPOOL_HOME": home})
        pool.vsdk("local", "up", "--agents", str(opts.agents), "--relays", "1", timeout=180)
        try:
            for _ in range(opts.repeat):
                figures["vpool"].append(on_pool(pool, opts.tasks, opts.workers, "module"))
                figures["unlogged"].append(
                    on_pool(
                        pool, opts.tasks, opts.workers, "module", extra=("--on-failure", "abort")
                    )
                )
            form = "spawn" if can_spawn(pool, opts.workers) else "module"
            rate = on_pool(pool, opts.tasks, opts.workers, form)["tasks_per_s"]
            n = max(opts.tasks, int(rate * opts.loss_seconds))
            for i in range(opts.repeat):
                figures["steady"].append(on_pool(pool, n, opts.workers, form))
                kill = killer_every(opts.loss_every, opts.seed + i)
                figures["losses"].append(on_pool(pool, n, opts.workers, form, kill))
        finally:
            pool.vsdk("local", "down", check=False, timeout=120)
    m = median([r["tasks_per_s"] for r in figures["mpich"]])
    v = median([r["tasks_per_s"] for r in figures["vpool"]])
    u = median([r["tasks_per_s"] for r in figures["unlogged"]])
    steady = median([r["seconds"] for r in figures["steady"]])
    lossy = median([r["seconds"] for r in figures["losses"]])
    last = figures["losses"][-1]
    right = all(r["right"] for rs in figures.values() for r in rs)
    print(f"farm of {opts.tasks} tasks, {opts.workers} workers ({opts.agents} agents, 1 relay)")
    print("| run | tasks/s | vs MPICH |\n|---|---|---|")
    print(f"| MPICH, mpiexec -n {opts.workers + 1} -m mpi4py.futures | {m:.0f} | 1.00x |")
    print(f"| vpool, -m mpi4py.futures | {v:.0f} | {v / m:.3f}x |")
    print(f"| vpool, the same with --on-failure abort (nothing logged) | {u:.0f} | {u / m:.3f}x |")
    print(
        f"one worker lost every {opts.loss_every:g} s ({form} form, {n} tasks): "
        f"{steady:.1f} s without losses, {lossy:.1f} s with {last['kills']} losses: "
        f"slowdown {lossy / steady:.2f}x; re-dispatched {last['redispatched']} tasks, "
        f"{last['failed_ranks']} workers failed, {last['restarts']} restarts; "
        f"every result right and once: {right}"
    )
    summary = {
        "mpich_tasks_per_s": m,
        "vpool_tasks_per_s": v,
        "vpool_unlogged_tasks_per_s": u,
        "ratio": v / m,
        "loss_form": form,
        "loss_tasks": n,
        "steady_s": steady,
        "with_losses_s": lossy,
        "slowdown": lossy / steady,
        "right": right,
    }
    print(json.dumps(summary))
    if opts.json:
        Path(opts.json).write_text(json.dumps({"summary": summary, "runs": figures}, indent=1))
    return 0 if right else 1


if __name__ == "__main__":
    stop_cleanly_on_sigterm()
    sys.exit(main())
