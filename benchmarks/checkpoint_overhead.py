"""Fault-free cost of periodic checkpoints: the same stencil with checkpoints off and on.

    .venv/bin/python benchmarks/checkpoint_overhead.py [--repeat N] [--every S] [--json FILE]

Issue 5 asks that a 4-rank stencil with about 200 MB per rank, checkpointing every 30 s with no
faults, runs at most 5% slower than with checkpoints off, and that the original process pauses
at most 5 ms (median) per checkpoint. This starts a local pool (``vsdk local up --agents 2
--relays 1`` in a temporary VPOOL_HOME, stopped at the end whatever happens) and submits
examples/stencil.py (``--steps``, ``--mb``; about 2 minutes with the defaults) as ordinary jobs,
once with ``vsdk submit --checkpoint-every S`` (default 30) and once without, ``--repeat``
times (default 1), the order alternating (off, on / on, off, ...) so that drift of the machine
hits both alike. Fault tolerance (message logging) is on in both: the difference is the
checkpoints alone.

Figures, per run and as medians over the repetitions:

- wall time: the job's ``finished - started`` from the coordinator (both stamped by this
  machine's clock), and the on/off ratio;
- checkpoints committed: the job's events of kind ``checkpoint`` (an image committed by a
  store), and of kind ``checkpoint_failed``;
- the pause of the original process per checkpoint (from the start of the runtime's
  ``take()`` to the return of ``fork()`` in the parent: the flushes and the fork), as the rank
  measures it and reports it in ``CkptForked.pause_us``: parsed
  with ``PAUSE`` below from the ``checkpoint`` events' messages (``... pause X ms ...``) or,
  when no event says it, from the agents' logs in the pool directory (``checkpoint C of rank
  R of job J: pause X ms, ...``, ``AGENT_LOG``). Median and maximum over every checkpoint of
  the runs with checkpoints on; the figures say which source they came from.

- CPU by part (``cpu_parts.CpuParts``: every process's own user and system time, sampled
  from ``/proc`` while the job runs, sorted into ranks, agents, relay, checkpoint workers,
  store process, CRIU, coordinator, kernel threads and the rest of the machine): per run, and
  the difference of the medians (on - off) per checkpoint committed: where a checkpoint's
  cost goes, the stolen CPU that becomes the on/off ratio on a machine the ranks keep busy.

Both runs must print the same checksum (checked). ``--json FILE`` keeps every run's figures.
``--set relay.KEY=VALUE`` (or ``agent.``, repeatable) appends ``KEY = VALUE`` (TOML) to the
config file of every relay (agent) of the pool and restarts it before the runs, to measure a
setting (``--set relay.store_nice=0``). The pool's agents reach the relay's store through its
same-host socket (``protocol.local``), as any agent on a relay's machine does;
``--set agent.store_local_socket=false`` measures loopback TCP instead, the way an agent
reaches a relay on another machine (with the transport MAC).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from chaos import Pool, stop_cleanly_on_sigterm, submit, wait_job
from cpu_parts import CpuParts

HERE = Path(__file__).resolve().parent
STENCIL = str(HERE.parent / "examples" / "stencil.py")
# The agent's wording in a `checkpoint` event, e.g. "rank 2: image 3 committed, 41.2 MB,
# pause 1.3 ms": the original process's pause for that checkpoint.
PAUSE = re.compile(r"pause ([0-9.]+) ms")
# "..., pause cpu 0.8 ms": the CPU time the original spent on it (the wall-clock pause also
# holds the time it waited for a CPU: 4 ranks share 2 cores here).
PAUSE_CPU = re.compile(r"pause cpu ([0-9.]+) ms")
# The agent's log line for each checkpoint it stored (worker_agent/checkpoints.py).
AGENT_LOG = re.compile(r"checkpoint \d+ of rank (\d+) of job (\d+): pause ([0-9.]+) ms")


def checkpoint_figures(events: list[dict]) -> dict:
    """Checkpoints committed and failed, and the pauses (ms) reported for the committed ones."""
    done = [e for e in events if e.get("kind") == "checkpoint"]
    pauses, cpus = [], []
    for e in done:
        m = PAUSE.search(str(e.get("message", "")))
        if m:
            pauses.append(float(m.group(1)))
        m = PAUSE_CPU.search(str(e.get("message", "")))
        if m:
            cpus.append(float(m.group(1)))
    return {
        "checkpoints": len(done),
        "checkpoints_failed": sum(e.get("kind") == "checkpoint_failed" for e in events),
        "pauses_ms": pauses,
        "pauses_cpu_ms": cpus,
    }


def logged_pauses(pool: Pool, job: int) -> list[float]:
    """The pauses (ms) the local pool's agents logged for ``job``'s checkpoints."""
    out = []
    for log in sorted((Path(pool.home) / "state" / "local-pool" / "logs").glob("agent-*.log")):
        for m in AGENT_LOG.finditer(log.read_text(errors="replace")):
            if int(m.group(2)) == job:
                out.append(float(m.group(3)))
    return out


def run_once(pool: Pool, opts: argparse.Namespace, every: float, name: str) -> dict:
    args = [str(opts.steps), f"{opts.mb:g}"]
    t0 = time.monotonic()
    with CpuParts() as cpu:
        job = submit(pool, STENCIL, opts.ranks, args, every)
        # The figure is the coordinator's finished - started: a slow poll costs no accuracy.
        state, detail = wait_job(pool, job, opts.limit, poll=5.0)
    polled = time.monotonic() - t0
    if state != "succeeded":
        raise RuntimeError(f"{name}: job {job} {state}: {json.dumps(detail)[-3000:]}")
    info = detail["job"]
    if every > 0 and float(info.get("checkpoint_every", 0)) != every:
        raise RuntimeError(f"{name}: the pool ran job {job} with {info.get('checkpoint_every')}")
    events = detail.get("events", [])
    res = {
        "job": job,
        "checkpoint_every": every,
        "seconds": float(info["finished"]) - float(info["started"]),
        "polled_seconds": polled,
        "output": pool.vsdk("logs", str(job)).strip(),
        **checkpoint_figures(events),
        "pause_source": "events",
        "cpu": cpu.parts(),
    }
    if every > 0 and not res["pauses_ms"]:
        res["pauses_ms"], res["pause_source"] = logged_pauses(pool, job), "agent logs"
    print(
        f"  {name}: {res['seconds']:.1f} s, {res['checkpoints']} checkpoint(s)",
        file=sys.stderr,
        flush=True,
    )
    return res


def stop(pool: Pool, name: str, limit: float = 60.0) -> None:
    """Stop the pool's component ``name`` (SIGTERM to the pid the pool recorded for it; this
    run started it) and wait until the pool sees it down."""
    pid = pool.processes().get(name)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + limit
    while name in pool.processes():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not stop within {limit:g} s")
        time.sleep(0.2)


def apply_settings(pool: Pool, home: Path, settings: list[str]) -> None:
    """``--set`` (module docstring): relays first, then agents, each restarted."""
    for kind in ("relay", "agent"):
        lines = []
        for item in settings:
            target, _, assignment = item.partition(".")
            key, eq, value = assignment.partition("=")
            if target not in ("relay", "agent") or not eq or not key:
                raise SystemExit(f"--set {item!r}: expected relay.KEY=VALUE or agent.KEY=VALUE")
            if target == kind:
                lines.append(f"{key.strip()} = {value.strip()}\n")
        if not lines:
            continue
        for config in sorted((home / "state" / "local-pool").glob(f"{kind}-*/config.toml")):
            config.write_text(config.read_text() + "".join(lines))
            name = config.parent.name
            stop(pool, name)
            pool.vsdk("local", "restart", name, timeout=120)
            print(f"  {name}: {''.join(lines).strip()}", file=sys.stderr, flush=True)


def measure(opts: argparse.Namespace) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="vpool-ckpt-bench-") as home:
        env = {**os.environ, "VPOOL_HOME": home}
        pool = Pool(home, env)
        pool.vsdk("local", "up", "--agents", str(opts.agents), "--relays", "1", timeout=180)
        try:
            apply_settings(pool, Path(home), opts.set)
            for i in range(opts.repeat):
                order = ("off", "on") if i % 2 == 0 else ("on", "off")
                for key in order:
                    every = opts.every if key == "on" else 0.0
                    runs[key].append(run_once(pool, opts, every, f"checkpoints {key} #{i}"))
        finally:
            pool.vsdk("local", "down", check=False, timeout=120)
    outputs = {r["output"] for r in runs["off"] + runs["on"]}
    if len(outputs) != 1:
        raise RuntimeError(f"the runs printed different checksums: {sorted(outputs)}")
    return runs


def summary(runs: dict[str, list[dict]]) -> dict:
    off = statistics.median(r["seconds"] for r in runs["off"])
    on = statistics.median(r["seconds"] for r in runs["on"])
    pauses = [p for r in runs["on"] for p in r["pauses_ms"]]
    cpus = [p for r in runs["on"] for p in r.get("pauses_cpu_ms", [])]
    parts = sorted({p for r in runs["off"] + runs["on"] for p in r["cpu"]})

    def cpu(key: str, part: str) -> float:
        return statistics.median(sum(r["cpu"].get(part, (0.0, 0.0))) for r in runs[key])

    checkpoints = statistics.median(r["checkpoints"] for r in runs["on"])
    return {
        "cpu_off": {p: cpu("off", p) for p in parts},
        "cpu_on": {p: cpu("on", p) for p in parts},
        "cpu_per_checkpoint": {
            p: (cpu("on", p) - cpu("off", p)) / checkpoints if checkpoints else None for p in parts
        },
        "off_s": off,
        "on_s": on,
        "ratio": on / off,
        "checkpoints": [r["checkpoints"] for r in runs["on"]],
        "checkpoints_failed": sum(r["checkpoints_failed"] for r in runs["on"]),
        "pauses_reported": len(pauses),
        "pause_source": ", ".join(sorted({r["pause_source"] for r in runs["on"]})),
        "pause_median_ms": statistics.median(pauses) if pauses else None,
        "pause_max_ms": max(pauses) if pauses else None,
        "pause_cpu_median_ms": statistics.median(cpus) if cpus else None,
        "pause_cpu_max_ms": max(cpus) if cpus else None,
    }


def report(opts: argparse.Namespace, runs: dict[str, list[dict]], s: dict) -> None:
    print(
        f"\ncheckpoint_overhead: examples/stencil.py {opts.steps} steps, {opts.ranks} ranks x "
        f"{opts.mb:g} MB, checkpoints every {opts.every:g} s, {opts.repeat} pair(s)"
    )
    if opts.set:
        print(f"settings         {', '.join(opts.set)}")
    for key in ("off", "on"):
        times = ", ".join(f"{r['seconds']:.1f}" for r in runs[key])
        print(f"checkpoints {key:4} {times} s (median {s[f'{key}_s']:.1f} s)")
    print(f"on/off           {s['ratio']:.3f}x ({(s['ratio'] - 1) * 100:+.1f}%)")
    print(f"committed        {s['checkpoints']} per run, {s['checkpoints_failed']} failed in all")
    if s["pause_median_ms"] is None:
        print("pause            not reported (no 'pause X ms' in the events nor agent logs)")
    else:
        print(
            f"pause            median {s['pause_median_ms']:.2f} ms, max {s['pause_max_ms']:.2f}"
            f" ms over {s['pauses_reported']} checkpoints (from the {s['pause_source']})"
        )
    if s["pause_cpu_median_ms"] is not None:
        print(
            f"pause cpu        median {s['pause_cpu_median_ms']:.2f} ms, max "
            f"{s['pause_cpu_max_ms']:.2f} ms (CPU time of the original: the wall-clock pause "
            "also holds its waits for a CPU)"
        )
    print("cpu s            off (median)   on (median)   on - off per checkpoint")
    per = s["cpu_per_checkpoint"]
    for part in sorted(s["cpu_on"], key=lambda p: -(per[p] or 0)):
        extra = "" if per[part] is None else f"{per[part]:+.3f}"
        print(f"  {part:18} {s['cpu_off'][part]:9.2f} {s['cpu_on'][part]:13.2f}   {extra:>10}")
    total = sum(v for v in per.values() if v is not None)
    print(
        f"  {'all':18} {sum(s['cpu_off'].values()):9.2f} {sum(s['cpu_on'].values()):13.2f}"
        f"   {total:+10.3f}"
    )
    print(f"output           {runs['off'][0]['output']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=1300, help="stencil steps (1300: about 2 min)")
    ap.add_argument("--mb", type=float, default=200.0, help="megabytes per rank")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--agents", type=int, default=2, help="agents of the local pool")
    ap.add_argument("--every", type=float, default=30.0, help="--checkpoint-every of the on runs")
    ap.add_argument("--repeat", type=int, default=1, help="off/on pairs; figures are medians")
    ap.add_argument("--limit", type=float, default=1800.0, help="s before a run is cancelled")
    ap.add_argument("--json", default="", help="also write every run and the summary here")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="relay.KEY=VALUE",
        help="a relay or agent setting for the pool (repeatable)",
    )
    opts = ap.parse_args()
    if opts.repeat < 1 or opts.every <= 0:
        ap.error("--repeat must be at least 1 and --every above 0")
    runs = measure(opts)
    s = summary(runs)
    report(opts, runs, s)
    if opts.json:
        Path(opts.json).write_text(json.dumps({"runs": runs, "summary": s}, indent=1))


if __name__ == "__main__":
    stop_cleanly_on_sigterm()
    main()
