"""Recovery after a rank is killed late in a run: restored from a checkpoint vs replayed from the
beginning.

    .venv/bin/python benchmarks/recovery.py [--every S] [--at 0.8] [--victim R] [--repeat N]
                                            [--json FILE]

Issue 5 asks, for one rank killed at 80% of a 2-minute run, the recovery time with checkpoints
and with replay from the beginning (with checkpoints at least 3x shorter). This starts a local
pool (``vsdk local up --agents 2 --relays 1`` in a temporary VPOOL_HOME, stopped at the end
whatever happens) and, for each of the two modes (``vsdk submit --checkpoint-every S``, default
30, and no checkpoints):

1. runs examples/stencil.py (``--steps``, ``--mb``, ``--ranks``: about 2 minutes with the
   defaults) without faults: its duration ``T`` is the job's ``finished - started`` from the
   coordinator;
2. runs it again and, ``--at`` x ``T`` after the job started, SIGKILLs the process of rank
   ``--victim`` (found among the agents' descendants, as ``benchmarks/chaos.py`` does: a rank
   restored earlier runs under ``unshare`` and the restore helper);
3. recovery = (kill -> job end) - (T - kill time): what the fault added to the run.

``--repeat N`` does steps 1-3 N times per mode (the modes alternating, so that drift of the
machine hits both alike) and reports the median recovery of each mode: a single pair moves by
a few seconds from run to run, which is the size of the recovery with checkpoints.

Both runs of a mode must print the same checksum (checked), and the events of the faulty run
tell how the rank came back (``rank_restored`` or ``rank_replaying``). Every run is cancelled
after ``--limit`` (default 3 x T + 120 s), so the benchmark stops by itself; exit code 0 when
both modes recovered with identical output.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from chaos import TERMINAL, Pool, job_state, rank_processes, submit, wait_job

HERE = Path(__file__).resolve().parent
STENCIL = str(HERE.parent / "examples" / "stencil.py")
POLL = 0.2
COUNTED = ("checkpoint", "rank_lost", "rank_restored", "restore_failed", "rank_replaying")


def _times(detail: dict) -> tuple[float, float]:
    job = detail["job"]
    return float(job["started"]), float(job["finished"])


def fault_free(pool: Pool, opts: argparse.Namespace, every: float) -> dict:
    job = submit(pool, STENCIL, opts.ranks, opts.args, every)
    state, detail = wait_job(pool, job, opts.limit or 1800)
    if state != "succeeded":
        raise RuntimeError(f"fault-free job {job} {state}: {json.dumps(detail)[-3000:]}")
    started, finished = _times(detail)
    return {"job": job, "seconds": finished - started, "output": pool.vsdk("logs", str(job))}


def _kill_victim(pool: Pool, job: int, victim: int, at: float, deadline: float) -> float | None:
    """SIGKILL rank ``victim`` of ``job`` once ``at`` s have passed since it started (the
    coordinator's clock); the time.time() of the kill, or None if the job ended first."""
    started = None
    while started is None:
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job} did not start in time")
        d = job_state(pool, job)
        if d is not None and d["job"]["state"] in TERMINAL:
            return None
        if d is not None and d["job"].get("started") is not None:
            started = float(d["job"]["started"])
        else:
            time.sleep(POLL)
    agents = {n: p for n, p in pool.processes().items() if n.startswith("agent-")}
    # Between vsdk calls (each a second or so): only /proc is read from here to the kill.
    while time.time() < started + at:
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job} did not reach {at:.1f} s in time")
        time.sleep(min(POLL, started + at - time.time()))
    for _ in range(200):  # 10 s: a rank just restored may be between processes
        pids = [p for _, p, r in rank_processes(agents, STENCIL, job) if r == victim]
        if len(pids) == 1:
            os.kill(pids[0], signal.SIGKILL)
            return time.time()
        time.sleep(0.05)
    d = job_state(pool, job)
    if d is not None and d["job"]["state"] in TERMINAL:
        return None
    raise RuntimeError(f"rank {victim} of job {job} was not found to kill: {pids}")


def faulty(pool: Pool, opts: argparse.Namespace, every: float, base: dict) -> dict:
    limit = opts.limit or 3 * base["seconds"] + 120
    job = submit(pool, STENCIL, opts.ranks, opts.args, every)
    killed = _kill_victim(
        pool, job, opts.victim, opts.at * base["seconds"], time.monotonic() + limit
    )
    if killed is None:
        raise RuntimeError(f"job {job} ended before the kill: raise --steps or lower --at")
    state, detail = wait_job(pool, job, limit)
    if state != "succeeded":
        raise RuntimeError(f"job {job} {state} after the kill: {json.dumps(detail)[-3000:]}")
    started, finished = _times(detail)
    kill_at = killed - started
    remainder = base["seconds"] - kill_at
    events = detail.get("events", [])
    return {
        "job": job,
        "seconds": finished - started,
        "kill_at_s": kill_at,
        "kill_to_end_s": finished - killed,
        "fault_free_remainder_s": remainder,
        "recovery_s": (finished - killed) - remainder,
        "identical": pool.vsdk("logs", str(job)) == base["output"],
        "events": {k: sum(e.get("kind") == k for e in events) for k in COUNTED},
        "victim_events": [
            f"{e['kind']}: {e.get('message', '')}"
            for e in events
            if e.get("rank") == opts.victim and e.get("kind") in COUNTED[1:]
        ],
    }


def measure(opts: argparse.Namespace) -> dict[str, list[dict]]:
    modes = {"checkpoints": opts.every, "replay": 0.0}
    modes = {m: e for m, e in modes.items() if opts.only in ("", m)}
    out: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="vpool-recovery-") as home:
        pool = Pool(home, {**os.environ, "VPOOL_HOME": home})
        pool.vsdk("local", "up", "--agents", str(opts.agents), "--relays", "1", timeout=180)
        try:
            for i in range(opts.repeat):
                order = list(modes.items()) if i % 2 == 0 else list(reversed(modes.items()))
                for mode, every in order:
                    base = fault_free(pool, opts, every)
                    print(
                        f"  {mode} #{i}: fault-free {base['seconds']:.1f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                    run = faulty(pool, opts, every, base)
                    print(
                        f"  {mode} #{i}: killed at {run['kill_at_s']:.1f} s, ended "
                        f"{run['seconds']:.1f} s, recovery {run['recovery_s']:.1f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                    out[mode].append(
                        {"checkpoint_every": every, "fault_free_s": base["seconds"], **run}
                    )
        finally:
            pool.vsdk("local", "down", check=False, timeout=120)
    return out


def _median_run(runs: list[dict]) -> dict:
    """The run of median recovery (the lower middle one for an even count)."""
    return sorted(runs, key=lambda r: r["recovery_s"])[(len(runs) - 1) // 2]


def report(opts: argparse.Namespace, runs: dict[str, list[dict]]) -> float | None:
    print(
        f"\nrecovery: examples/stencil.py {' '.join(opts.args)} on {opts.ranks} ranks, rank "
        f"{opts.victim} SIGKILLed at {opts.at:.0%} of the fault-free time, {opts.repeat} run(s) "
        "per mode (the columns: the run of median recovery)"
    )
    res = {m: _median_run(r) for m, r in runs.items() if r}
    modes = [m for m in ("checkpoints", "replay") if m in res]
    print(f"{'':24}" + "".join(f"{m:>14}" for m in modes))
    rows = [
        (
            "checkpoint every",
            lambda r: f"{r['checkpoint_every']:g} s" if r["checkpoint_every"] else "-",
        ),
        ("fault-free", lambda r: f"{r['fault_free_s']:.1f} s"),
        ("kill at", lambda r: f"{r['kill_at_s']:.1f} s"),
        ("with the kill", lambda r: f"{r['seconds']:.1f} s"),
        ("kill -> end", lambda r: f"{r['kill_to_end_s']:.1f} s"),
        ("fault-free remainder", lambda r: f"{r['fault_free_remainder_s']:.1f} s"),
        ("recovery", lambda r: f"{r['recovery_s']:.1f} s"),
        ("output", lambda r: "identical" if r["identical"] else "DIFFERENT"),
    ]
    for label, cell in rows:
        print(f"{label:24}" + "".join(f"{cell(res[m]):>14}" for m in modes))
    for mode in modes:
        every = ", ".join(f"{r['recovery_s']:.1f}" for r in runs[mode])
        print(f"{mode} recovery, every run: {every} s")
    for mode in modes:
        print(f"{mode} events: {res[mode]['events']}")
        for line in res[mode]["victim_events"]:
            print(f"  {line}")
    if len(modes) < 2:
        return None
    ckpt, replay = res["checkpoints"]["recovery_s"], res["replay"]["recovery_s"]
    ratio = replay / ckpt if ckpt > 0 else None
    shown = f"{ratio:.2f}" if ratio is not None else f"- (recovery with checkpoints {ckpt:.1f} s)"
    print(f"replay / checkpoints recovery: {shown} (issue 5 asks at least 3)")
    return ratio


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=1300, help="stencil steps (1300: about 2 min)")
    ap.add_argument("--mb", type=float, default=200.0, help="megabytes per rank")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--agents", type=int, default=2, help="agents of the local pool")
    ap.add_argument("--every", type=float, default=30.0, help="--checkpoint-every (s)")
    ap.add_argument("--at", type=float, default=0.8, help="kill at this fraction of the run")
    ap.add_argument("--victim", type=int, default=1, help="the rank killed")
    ap.add_argument(
        "--only", choices=["checkpoints", "replay"], default="", help="run one mode only"
    )
    ap.add_argument("--limit", type=float, default=0.0, help="s before a run is cancelled")
    ap.add_argument("--repeat", type=int, default=1, help="runs per mode; medians reported")
    ap.add_argument("--json", default="", help="also write the figures here")
    opts = ap.parse_args()
    if opts.repeat < 1:
        ap.error("--repeat must be at least 1")
    if not 0 < opts.at < 1 or opts.every <= 0 or not 0 <= opts.victim < opts.ranks:
        ap.error("need 0 < --at < 1, --every > 0 and 0 <= --victim < --ranks")
    opts.args = [str(opts.steps), f"{opts.mb:g}"]
    res = measure(opts)
    ratio = report(opts, res)
    if opts.json:
        Path(opts.json).write_text(json.dumps({"runs": res, "ratio": ratio}, indent=1))
    return 0 if all(r["identical"] for rs in res.values() for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
