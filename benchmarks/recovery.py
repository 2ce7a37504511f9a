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

The fault-free run of step 1 is another run, and on this kind of machine two runs of the same
job differ by up to 20% (15 s of a 2-minute run), as much as the recovery itself; ``T - kill
time`` also counts against the fault any lead or lag the faulty run had at the kill. Rank 0 of
the stencil notes the time every 10 steps in both runs (its PROGRESS argument, a file in the
pool's directory), which gives

- **aligned recovery** = (rank 0's last step - kill) - (the time the fault-free run took from
  the step the faulty run had reached at the kill to its end): the same definition, with the
  fault-free remainder being the time the fault-free run needed for exactly the steps that
  remained (the figure the issue's definition names; the two runs still differ in pace);
- **in-run recovery** = (rank 0's last step - kill) - (steps left at the kill / rank 0's step
  rate over the 30 s before the kill): the same definition, with the fault-free remainder taken
  from the run's own pace instead of from another run;
- **stall** = how long after the kill rank 0 took to get 20 steps past where it was, minus
  what 20 steps take at that pace: the time the job stood still while the victim came back.

With checkpoints, ``image age`` is how old the victim's image was when it was killed (the
checkpoint's id is the wall-clock millisecond it was taken at). The recovery with checkpoints
grows with it (the restored rank computes again what it did since the image): with a 30 s
period, a kill at 80% of a 120 s run comes about 6 s after the third round of images, one at
80% of a 110 s run nearly 30 s after the second. ``--at`` moves the kill to other phases.

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
import itertools
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from chaos import (
    TERMINAL,
    Pool,
    job_state,
    rank_processes,
    stop_cleanly_on_sigterm,
    submit,
    wait_job,
)

HERE = Path(__file__).resolve().parent
STENCIL = str(HERE.parent / "examples" / "stencil.py")
POLL = 0.2
PACE_WINDOW = 30.0  # s before the kill over which rank 0's pace is measured
STALL_STEPS = 20
COUNTED = ("checkpoint", "rank_lost", "rank_restored", "restore_failed", "rank_replaying")


def _times(detail: dict) -> tuple[float, float]:
    job = detail["job"]
    return float(job["started"]), float(job["finished"])


def _progress_file(pool: Pool, tag: str) -> str:
    path = Path(pool.env["VPOOL_HOME"]) / f"progress-{tag}.txt"
    path.unlink(missing_ok=True)
    return str(path)


def read_progress(path: str) -> list[tuple[int, float]]:
    """(step, time.time()) pairs rank 0 of the stencil noted, in order."""
    out = []
    for line in Path(path).read_text().splitlines():
        step, at = line.split()
        out.append((int(step), float(at)))
    return out


def _step_at(samples: list[tuple[int, float]], t: float) -> float:
    """Rank 0's step at time ``t``, interpolated between the samples around it."""
    for (s0, t0), (s1, t1) in itertools.pairwise(samples):
        if t0 <= t <= t1:
            return s0 + (s1 - s0) * (t - t0) / (t1 - t0) if t1 > t0 else float(s1)
    return float(samples[0][0] if t < samples[0][1] else samples[-1][0])


def _time_at(samples: list[tuple[int, float]], step: float) -> float | None:
    """When rank 0 reached ``step``, interpolated between the samples around it."""
    for (s0, t0), (s1, t1) in itertools.pairwise(samples):
        if s0 <= step <= s1:
            return t0 + (t1 - t0) * (step - s0) / (s1 - s0) if s1 > s0 else t1
    return None


def aligned(samples: list[tuple[int, float]], killed: float, free: list[tuple[int, float]]) -> dict:
    """Recovery with the fault-free remainder read off the fault-free run's own progress: the
    time it took from the step the faulty run had reached at the kill to its last step."""
    if len(samples) < 3 or len(free) < 3 or samples[-1][1] <= killed:
        return {}
    at_kill = _step_at(samples, killed)
    t = _time_at(free, at_kill)
    if t is None or free[-1][0] != samples[-1][0]:
        return {}
    remainder = free[-1][1] - t
    return {
        "aligned_remainder_s": remainder,
        "aligned_recovery_s": (samples[-1][1] - killed) - remainder,
    }


def in_run(samples: list[tuple[int, float]], killed: float) -> dict:
    """In-run recovery and stall of a run whose rank 0 noted ``samples``, killed at ``killed``
    (both time.time()); see the module's docstring."""
    if len(samples) < 3 or samples[-1][1] <= killed:
        return {}
    window = min(PACE_WINDOW, killed - samples[0][1])
    at_kill = _step_at(samples, killed)
    pace = (at_kill - _step_at(samples, killed - window)) / window  # steps/s
    if pace <= 0:
        return {}
    last_step, last_t = samples[-1]
    out = {
        "pace_steps_per_s": pace,
        "step_at_kill": at_kill,
        "in_run_remainder_s": (last_step - at_kill) / pace,
        "in_run_recovery_s": (last_t - killed) - (last_step - at_kill) / pace,
    }
    past = next((t for s, t in samples if s >= at_kill + STALL_STEPS), None)
    if past is not None:
        out["stall_s"] = (past - killed) - STALL_STEPS / pace
    return out


def fault_free(pool: Pool, opts: argparse.Namespace, every: float, tag: str) -> dict:
    progress = _progress_file(pool, f"{tag}-free")
    job = submit(pool, STENCIL, opts.ranks, [*opts.args, progress], every)
    state, detail = wait_job(pool, job, opts.limit or 1800)
    if state != "succeeded":
        raise RuntimeError(f"fault-free job {job} {state}: {json.dumps(detail)[-3000:]}")
    started, finished = _times(detail)
    return {
        "job": job,
        "seconds": finished - started,
        "output": pool.vsdk("logs", str(job)),
        "progress": read_progress(progress),
    }


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


def faulty(pool: Pool, opts: argparse.Namespace, every: float, base: dict, tag: str) -> dict:
    limit = opts.limit or 3 * base["seconds"] + 120
    progress = _progress_file(pool, tag)
    job = submit(pool, STENCIL, opts.ranks, [*opts.args, progress], every)
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
    restored = [
        int(e["message"].rsplit(" ", 1)[1]) / 1000
        for e in events
        if e.get("rank") == opts.victim
        and e.get("kind") == "rank_restored"
        and e.get("message", "").rsplit(" ", 1)[-1].isdigit()
    ]
    samples = read_progress(progress)
    return {
        **in_run(samples, killed),
        **aligned(samples, killed, base["progress"]),
        "image_age_s": killed - restored[0] if restored else None,
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
                    base = fault_free(pool, opts, every, f"{mode}-{i}")
                    print(
                        f"  {mode} #{i}: fault-free {base['seconds']:.1f} s",
                        file=sys.stderr,
                        flush=True,
                    )
                    run = faulty(pool, opts, every, base, f"{mode}-{i}")
                    print(
                        f"  {mode} #{i}: killed at {run['kill_at_s']:.1f} s, ended "
                        f"{run['seconds']:.1f} s, recovery {run['recovery_s']:.1f} s, aligned "
                        f"{_s(run.get('aligned_recovery_s'))}, in-run "
                        f"{_s(run.get('in_run_recovery_s'))}, stall {_s(run.get('stall_s'))}, "
                        f"image age {_s(run.get('image_age_s'))}",
                        file=sys.stderr,
                        flush=True,
                    )
                    out[mode].append(
                        {"checkpoint_every": every, "fault_free_s": base["seconds"], **run}
                    )
        finally:
            pool.vsdk("local", "down", check=False, timeout=120)
    return out


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f} s"


def _median(runs: list[dict], key: str) -> float | None:
    vals = sorted(r[key] for r in runs if r.get(key) is not None)
    return vals[(len(vals) - 1) // 2] if vals else None


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
        ("aligned remainder", lambda r: _s(r.get("aligned_remainder_s"))),
        ("aligned recovery", lambda r: _s(r.get("aligned_recovery_s"))),
        ("in-run remainder", lambda r: _s(r.get("in_run_remainder_s"))),
        ("in-run recovery", lambda r: _s(r.get("in_run_recovery_s"))),
        ("stall", lambda r: _s(r.get("stall_s"))),
        ("image age at the kill", lambda r: _s(r.get("image_age_s"))),
        ("output", lambda r: "identical" if r["identical"] else "DIFFERENT"),
    ]
    for label, cell in rows:
        print(f"{label:24}" + "".join(f"{cell(res[m]):>14}" for m in modes))
    for mode in modes:
        for key in ("recovery_s", "aligned_recovery_s", "in_run_recovery_s", "stall_s"):
            every = ", ".join(_s(r.get(key)) for r in runs[mode])
            print(f"{mode} {key[:-2].replace('_', ' ')}, every run: {every}")
    for mode in modes:
        print(f"{mode} events: {res[mode]['events']}")
        for line in res[mode]["victim_events"]:
            print(f"  {line}")
    if len(modes) < 2:
        return None
    ratio = None
    for key, label in (
        ("recovery_s", "recovery"),
        ("aligned_recovery_s", "aligned recovery"),
        ("in_run_recovery_s", "in-run recovery"),
        ("stall_s", "stall"),
    ):
        ckpt, replay = _median(runs["checkpoints"], key), _median(runs["replay"], key)
        if ckpt is None or replay is None:
            continue
        r = replay / ckpt if ckpt > 0 else None
        shown = f"{r:.2f}" if r is not None else "-"
        print(
            f"replay / checkpoints {label} (medians {replay:.1f} / {ckpt:.1f} s): {shown} "
            "(issue 5 asks at least 3)"
        )
        if key == "recovery_s":
            ratio = r
    return ratio


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=1600, help="stencil steps (1600: about 2 min)")
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
    stop_cleanly_on_sigterm()
    sys.exit(main())
