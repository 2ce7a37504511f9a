"""What one lost rank costs a job in each of FT-MPI's failure modes (blank, shrink, rebuild).

    .venv/bin/python benchmarks/ftmpi_recovery.py [--ranks 4] [--n 1200000] [--iterations 40]
                                                  [--modes blank,shrink,rebuild] [--agents 2]
                                                  [--limit 180] [--repeat 1] [--json FILE]

The program is benchmarks/programs/ftmpi_timed.py: examples/ftmpi_modes.py (an iterative sum
whose survivors recover by rebuilding the world with ``MPI.COMM_WORLD.Dup()``), the same
computation and answer, with timestamps on stderr. This starts a local pool (``vsdk local up
--agents A --relays 1`` in a temporary VPOOL_HOME, stopped at the end whatever happens) and, for
each mode in turn, submits it twice with ``vsdk submit --ranks R --on-failure MODE``:

1. **fault-free**, ``N ITERATIONS`` (defaults: 4 ranks, 1,200,000 x 40, about 15-20 s on a
   2-core machine): each mode has its own fault-free run, just before its faulty one, so
   that the machine's drift hits both alike;
2. **one failure**: the same with ``--die R/2:ITERATIONS/2``: a middle rank SIGKILLs itself as
   it starts the middle iteration. The pool declares it failed, fences it at the relay, tells
   the others; their next operation on the world fails and each calls ``Dup()``, which leaves
   a hole (blank), closes the world up (shrink) or waits for a fresh process the pool spawns
   in the lost rank's place (rebuild). The iteration in progress is computed again.

Figures per mode (every time is this machine's ``time.time()``, which the coordinator also
stamps its events with):

- **wall**: the faulty job's ``finished - created`` as the coordinator recorded it (its
  submission to its end, without the ``vsdk`` process's own start);
- **ratio**: wall / the same mode's fault-free wall, from this invocation;
- **recovery**: from the moment the rank died (its own stamp, printed and flushed just before
  it kills itself) to the moment the last survivor left ``MPI.COMM_WORLD.Dup()`` (its stamp),
  split into **declared** (died -> the job's ``rank_failed`` event: the pool noticed the loss
  and declared it), **noticed** (died -> the last survivor's operation failed with
  ``MPI.ERR_PROC_FAILED``: the relays fenced the rank and the agents told the survivors, who
  were perhaps computing and noticed at their next operation) and **Dup** (the last notice ->
  the last survivor out of ``Dup()``: agreeing the failed set and rebuilding; in rebuild mode
  it includes starting the replacement: ``spawn`` is from the job's ``spawn`` event, the
  survivors' ``Dup()`` asking for it, to the replacement's own stamp out of ``Dup()``);
- **right**: the job succeeded, the failed rank is the one killed (and in rebuild mode one
  process was spawned), and stdout equals the fault-free run's, byte for byte.

What the ratio also counts: the work lost (the iteration in progress at the death, computed
again), and the pace after the failure: blank and shrink go on with R-1 ranks, rebuild with R.
On a machine with fewer cores than ranks the survivors' pace barely changes (they get the dead
rank's share of the CPU), elsewhere it drops by up to 1/R.

Where the time goes, as measured on a local pool: declaring the loss takes tens of ms (the
agent sees its rank's process die and reports it); most of **noticed** is the fence's trip, which
rides the relay's heartbeat (its answer names the fence, the next heartbeat confirms it: up to
one heartbeat interval, 2 s by default, after the declaration), and then the held heartbeats of
the agents, which tell their ranks. ``--json`` keeps every stamp and event of every run, per
rank, for a closer look.

Wall times of two runs differ by far more than a recovery on a busy machine (the default run is
one pair per mode, under 3 minutes); ``--repeat N`` runs N rounds of the modes, each mode's
fault-free and faulty runs next to each other, and reports the median of each figure (the
ratio: the median of the pairs' ratios). The recovery figures come from one run's own stamps
and depend little on the machine's load.

Every wait has a deadline (``--limit`` per job); a job still running then is cancelled, and
every job is cancelled at the end whatever happened. Exit code 0 when every answer is right.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from chaos import Pool, stop_cleanly_on_sigterm, wait_job

HERE = Path(__file__).resolve().parent
PROGRAM = str(HERE / "programs" / "ftmpi_timed.py")
MODES = ("blank", "shrink", "rebuild")
FIGURES = (
    "fault_free_s",
    "wall_s",
    "ratio",
    "recovery_s",
    "declared_s",
    "noticed_s",
    "dup_s",
    "spawn_s",
)
STAMP = re.compile(r"^ftmpi_timed (\w+) (.*)$")


def run(pool: Pool, mode: str, opts: argparse.Namespace, die: tuple[int, int] | None) -> dict:
    """One job of the program in ``mode`` (killing rank ``die[0]`` at iteration ``die[1]``):
    its state, wall time, stdout, stamps and events."""
    args = [str(opts.n), str(opts.iterations)]
    if die is not None:
        args += ["--die", f"{die[0]}:{die[1]}"]
    cmd = ("submit", PROGRAM, "--ranks", str(opts.ranks), "--on-failure", mode, "--json")
    job = int(json.loads(pool.vsdk(*cmd, "--", *args))["id"])
    what = f"rank {die[0]} dies at iteration {die[1]}" if die else "fault-free"
    print(f"  job {job}: {mode}, {what}", file=sys.stderr)
    try:
        state, detail = wait_job(pool, job, opts.limit, poll=0.5)
        stdout = pool.vsdk("logs", str(job), check=False, timeout=60)
        stamps = stamps_of(pool, job)
    finally:
        pool.vsdk("cancel", str(job), check=False)
    info = detail.get("job", {})
    wall = None
    if state == "succeeded" and info.get("finished") is not None:
        wall = info["finished"] - info["created"]
    return {
        "job": job,
        "mode": mode,
        "die": list(die) if die else None,
        "state": state,
        "wall_s": wall,
        "stdout": stdout,
        "failed_ranks": info.get("failed_ranks", []),
        "spawned": info.get("spawned", 0),
        "stamps": stamps,
        "events": [
            {k: e.get(k) for k in ("time", "kind", "rank", "message")}
            for e in detail.get("events", [])
        ],
    }


def stamps_of(pool: Pool, job: int) -> list[dict]:
    """The program's ``ftmpi_timed`` lines on stderr, each as {"what", "pool_rank", fields...}
    (``pool_rank``: the rank the pool ran it as; a replacement's is a spawned rank's)."""
    text: dict[int, bytes] = {}
    after, deadline = 0, time.monotonic() + 60
    while time.monotonic() < deadline:
        page = pool.client().output(job, after=after, wait=2.0)
        for rec in page.records:
            if rec.stream == "stderr":
                text[rec.rank] = text.get(rec.rank, b"") + rec.data
        after = page.next
        if page.complete:
            break
    out = []
    for rank, data in sorted(text.items()):
        for line in data.decode(errors="replace").splitlines():
            m = STAMP.match(line)
            if m is None:
                continue
            fields = dict(kv.split("=", 1) for kv in m.group(2).split() if "=" in kv)
            stamp: dict = {"what": m.group(1), "pool_rank": rank}
            for k, v in fields.items():
                stamp[k] = float(v) if k in ("time", "started") else int(v)
            out.append(stamp)
    return out


def recovery(faulty: dict) -> dict:
    """The recovery's figures (seconds; None where a stamp or event is missing)."""
    stamps = faulty["stamps"]
    died = [s["time"] for s in stamps if s["what"] == "died"]
    noticed = [s["time"] for s in stamps if s["what"] == "noticed"]
    rebuilt = [s["time"] for s in stamps if s["what"] == "rebuilt"]
    declared = [e["time"] for e in faulty["events"] if e["kind"] == "rank_failed"]
    spawns = [e["time"] for e in faulty["events"] if e["kind"] == "spawn"]
    joined = [s["time"] for s in stamps if s["what"] == "replacement"]
    if len(died) != 1:
        return {"recovery_s": None, "declared_s": None, "noticed_s": None, "dup_s": None}
    t = died[0]
    out = {
        "recovery_s": max(rebuilt) - t if rebuilt else None,
        "declared_s": min(declared) - t if declared else None,
        "noticed_s": max(noticed) - t if noticed else None,
        "dup_s": max(rebuilt) - max(noticed) if rebuilt and noticed else None,
        "survivors": len(rebuilt),
    }
    if spawns and joined:  # rebuild: the first spawn request -> the replacement in the world
        out["spawn_s"] = max(joined) - min(spawns)
    return out


def right(mode: str, faulty: dict, base: dict, victim: int) -> bool:
    ok = (
        faulty["state"] == base["state"] == "succeeded"
        and faulty["stdout"] != ""
        and faulty["stdout"] == base["stdout"]
        and faulty["failed_ranks"] == [victim]
    )
    if mode == "rebuild":
        ok = ok and faulty["spawned"] == 1
    return ok


def pair(mode: str, base: dict, faulty: dict, victim: int) -> dict:
    """The figures of one fault-free run and the faulty one after it."""
    ratio = None
    if base["wall_s"] and faulty["wall_s"] is not None:
        ratio = faulty["wall_s"] / base["wall_s"]
    return {
        "fault_free_s": base["wall_s"],
        "wall_s": faulty["wall_s"],
        "ratio": ratio,
        **recovery(faulty),
        "right": right(mode, faulty, base, victim),
    }


def summary(mode: str, pairs: list[dict]) -> dict:
    """A mode's row: the median of each figure over its pairs; right if every one was."""
    row: dict = {"mode": mode, "right": bool(pairs) and all(p["right"] for p in pairs)}
    for key in FIGURES:
        values = sorted(p[key] for p in pairs if p.get(key) is not None)
        row[key] = values[len(values) // 2] if values else None
    return row


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


def wait_for_ci(deadline: float = 1800) -> None:
    """Don't measure on a machine a full CI run is loading: wait (every minute, at most
    ``deadline`` s) while a /tmp/ci*.time file has no ``real`` line yet."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        running = []
        for f in Path("/tmp").glob("ci*.time"):
            try:
                lines = f.read_text().splitlines()
            except OSError:
                continue
            if not any(line.startswith("real") for line in lines):
                running.append(f.name)
        if not running:
            return
        print(f"  a CI run is going on ({', '.join(running)}): waiting", file=sys.stderr)
        time.sleep(60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--n", type=int, default=1_200_000, help="terms summed per iteration")
    ap.add_argument("--iterations", type=int, default=40)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--limit", type=float, default=180.0, help="s before a job is cancelled")
    ap.add_argument("--repeat", type=int, default=1, help="pairs per mode (medians)")
    ap.add_argument("--json", default="")
    opts = ap.parse_args()
    modes = [m for m in opts.modes.split(",") if m]
    if any(m not in MODES for m in modes) or opts.ranks < 2:
        ap.error(f"modes are among {', '.join(MODES)}, and a failure needs 2 ranks at least")
    victim, at = opts.ranks // 2, opts.iterations // 2
    wait_for_ci()
    pairs: dict[str, list[dict]] = {m: [] for m in modes}
    runs = []
    with tempfile.TemporaryDirectory(prefix="vpool-ftmpi-") as home:
        pool = Pool(home, {**os.environ, "VPOOL_HOME": home})
        pool.vsdk("local", "up", "--agents", str(opts.agents), "--relays", "1", timeout=180)
        try:
            for _ in range(opts.repeat):
                for mode in modes:
                    base = run(pool, mode, opts, None)
                    faulty = run(pool, mode, opts, (victim, at))
                    runs += [base, faulty]
                    pairs[mode].append(pair(mode, base, faulty, victim))
        finally:
            pool.vsdk("local", "down", check=False, timeout=120)
    rows = [summary(mode, pairs[mode]) for mode in modes]
    print(
        f"ftmpi_timed.py {opts.n} {opts.iterations} on {opts.ranks} ranks ({opts.agents} "
        f"agents, 1 relay, {os.cpu_count()} cores); rank {victim} killed at iteration {at}"
        + (f"; medians of {opts.repeat} pairs" if opts.repeat > 1 else "")
    )
    print(
        "| mode | fault-free s | wall s | ratio | recovery s | declared s | noticed s | Dup s "
        "| right |\n|---|---|---|---|---|---|---|---|---|"
    )
    for r in rows:
        dup = fmt(r["dup_s"])
        if r.get("spawn_s") is not None:
            dup += f" (spawn {fmt(r['spawn_s'])})"
        print(
            f"| {r['mode']} | {fmt(r['fault_free_s'], '.1f')} | {fmt(r['wall_s'], '.1f')} "
            f"| {fmt(r['ratio'], '.3f')}x | {fmt(r['recovery_s'])} | {fmt(r['declared_s'])} "
            f"| {fmt(r['noticed_s'])} | {dup} | {r['right']} |"
        )
    if opts.json:
        Path(opts.json).write_text(
            json.dumps(
                {
                    "program": PROGRAM,
                    "n": opts.n,
                    "iterations": opts.iterations,
                    "ranks": opts.ranks,
                    "victim": victim,
                    "at": at,
                    "rows": rows,
                    "pairs": pairs,
                    "runs": runs,
                },
                indent=1,
            )
        )
    return 0 if rows and all(r["right"] for r in rows) else 1


if __name__ == "__main__":
    stop_cleanly_on_sigterm()
    sys.exit(main())
