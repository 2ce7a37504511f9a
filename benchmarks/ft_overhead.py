"""Fault-free overhead of message logging: the same benchmarks with fault tolerance on and off.

    .venv/bin/python benchmarks/ft_overhead.py [--quick] [--repeat N] [--json FILE]

Issue 4 asks for the overhead of logging in a run without faults, against the same benchmarks
with logging off. This starts a local pool (``vsdk local up --agents 2 --relays 1`` in a
temporary VPOOL_HOME, stopped at the end whatever happens) and submits the unmodified mpi4py
program benchmarks/programs/mpi_bench.py as ordinary jobs:

- at 2 ranks (one on each agent): round trips per size and streaming bandwidth (and the
  collectives at 2 ranks);
- at 4 ranks with ``--no-p2p``: ``Allreduce`` of 8 doubles and ``Barrier``;

each once with fault tolerance on (the default) and once with ``vsdk submit
--no-fault-tolerance`` (leases carry ``VPOOL_FT=0``: the ranks make no determinant and never
wait for a ``DetAck``). Pairs of on/off runs are repeated ``--repeat`` times (default 3), the
order alternating (on, off / off, on, ...) so that drift of the machine hits both alike, and
each figure is the median over the repetitions. The table shows figure, FT on, FT off and the
on/off ratio (times: above 1 means logging costs; bandwidth: below 1 means it costs).

What logging costs in this program. mpi_bench.py names every source, so its receives and
collectives make no determinant; what does is ``MPI.Wtime``, which it calls only around timed
loops (once before, once after), as a real program would. With fault tolerance on, the value
read at the start of a loop is a determinant: the first deposit after it waits for the home
relay to make it durable and acknowledge it (one round trip rank -> agent -> relay and back),
which the loop's time includes once, spread over its iterations. The per-message cost of the
pessimistic rule when nothing was decided by timing is one integer comparison. Programs that
receive from ``ANY_SOURCE`` or poll with ``Test``/``Iprobe`` pay one determinant round trip per
decision followed by a send (see docs/internals.md, "Fault tolerance").

``--quick`` (a smoke run, under about 2 minutes even with the default 3 repetitions) passes
``--quick`` to the program: fewer sizes and iterations. On a busy machine the spread between
runs can exceed the overhead; ``--json`` keeps every run's figures to judge it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
VSDK = str(BIN / "vsdk")
PROGRAM = str(HERE / "programs" / "mpi_bench.py")
TIMEOUT = 900
KiB, MiB = 1024, 1024 * 1024

Results = dict[int, dict]  # ranks -> the program's JSON line


def _run(cmd: list[str], env: dict[str, str], timeout: float = TIMEOUT) -> str:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out.stdout


def _last_json(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"the benchmark printed no JSON line:\n{text[-2000:]}")
    return json.loads(lines[-1])


def _program_args(quick: bool, nranks: int) -> list[str]:
    args = ["--quick"] if quick else []
    return args if nranks == 2 else [*args, "--no-p2p"]


def run_job(env: dict[str, str], nranks: int, ft: bool, quick: bool, name: str) -> dict:
    cmd = [VSDK, "submit", PROGRAM, "--ranks", str(nranks), "--wait", "--name", name]
    if not ft:
        cmd.append("--no-fault-tolerance")
    return _last_json(_run([*cmd, "--", *_program_args(quick, nranks)], env))


def _check_flags(env: dict[str, str], names: dict[str, bool]) -> None:
    """The pool ran each job with the fault tolerance it was meant to have."""
    jobs = json.loads(_run([VSDK, "jobs", "--json"], env))
    seen = {j["name"]: j.get("fault_tolerance", True) for j in jobs}
    wrong = [n for n, ft in names.items() if seen.get(n) != ft]
    if wrong:
        raise RuntimeError(f"jobs ran with the wrong fault tolerance setting: {wrong}")


def measure(quick: bool, repeat: int, sizes: tuple[int, ...] = (2, 4)) -> dict[str, list[Results]]:
    """Every run's results: ``{"on": [run, ...], "off": [...]}``, runs in repetition order."""
    runs: dict[str, list[Results]] = {"on": [], "off": []}
    names: dict[str, bool] = {}
    with tempfile.TemporaryDirectory(prefix="vpool-ft-bench-") as home:
        env = {**os.environ, "VPOOL_HOME": home}
        env.pop("VPOOL_FT", None)  # the pool decides, per job
        _run([VSDK, "local", "up", "--agents", "2", "--relays", "1"], env, 120)
        try:
            for i in range(repeat):
                order = (True, False) if i % 2 == 0 else (False, True)
                for ft in order:
                    key = "on" if ft else "off"
                    res: Results = {}
                    for n in sizes:
                        name = f"ft-{key}-n{n}-{i}"
                        names[name] = ft
                        res[n] = run_job(env, n, ft, quick, name)
                        print(f"  {name}: done", file=sys.stderr, flush=True)
                    runs[key].append(res)
            _check_flags(env, names)
        finally:
            _run([VSDK, "local", "down"], env, 120)
    return runs


# -- report ----------------------------------------------------------------------------------

Figure = tuple[str, str, Callable[[Results], float | None]]


def _get(n: int, *path: str) -> Callable[[Results], float | None]:
    def pick(res: Results) -> float | None:
        value: object = res.get(n, {})
        for key in path:
            if not isinstance(value, dict):
                return None
            value = value.get(key)
        return float(value) if isinstance(value, int | float) else None

    return pick


FIGURES: list[Figure] = [
    ("round trip 8 B", "time", _get(2, "rtt", "8")),
    ("round trip 32 KiB", "time", _get(2, "rtt", str(32 * KiB))),
    ("stream 16 MiB (MiB/s)", "bw", _get(2, "bw", str(16 * MiB))),
    ("allreduce 8 doubles n=4", "time", _get(4, "allreduce_8d")),
    ("barrier n=4", "time", _get(4, "barrier")),
    ("allreduce 8 doubles n=2", "time", _get(2, "allreduce_8d")),
    ("barrier n=2", "time", _get(2, "barrier")),
]


def _t(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def medians(runs: dict[str, list[Results]]) -> dict[str, dict[str, float | None]]:
    out: dict[str, dict[str, float | None]] = {}
    for label, _, pick in FIGURES:
        row: dict[str, float | None] = {}
        for key in ("on", "off"):
            values = [v for v in (pick(r) for r in runs[key]) if v is not None]
            row[key] = statistics.median(values) if values else None
        out[label] = row
    return out


def report(
    runs: dict[str, list[Results]],
    elapsed: float,
    *,
    title: str = "ft_overhead",
    what: str = "FT",
    cost: str = "logging",
) -> dict[str, dict[str, float | None]]:
    """Print the medians of the "on" and "off" runs side by side, with their ratio; ``what``
    names the switch in the columns, ``cost`` what the ratio is the cost of."""
    table = medians(runs)
    repeat = len(runs["on"])
    print(f"\n{title}: {elapsed:.0f} s, median of {repeat} run(s) each; times per operation")
    print(f"{'figure':26}{what + ' on':>12}{what + ' off':>12}{'on/off':>9}")
    for label, kind, _ in FIGURES:
        on, off = table[label]["on"], table[label]["off"]
        fmt = (lambda v: "-" if v is None else f"{v:.0f}") if kind == "bw" else _t
        ratio = f"{on / off:.2f}x" if on and off else "-"
        table[label]["ratio"] = on / off if on and off else None
        print(f"{label:26}{fmt(on):>12}{fmt(off):>12}{ratio:>9}")
    print(f"(times: on/off above 1 is the cost of {cost}; bandwidth: below 1 is)")
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and iterations (< 2 min)")
    ap.add_argument(
        "--repeat", type=int, default=3, help="on/off pairs to run; figures are medians"
    )
    ap.add_argument("--json", default="", help="also write every run and the medians here")
    opts = ap.parse_args()
    if opts.repeat < 1:
        ap.error("--repeat must be at least 1")
    t0 = time.monotonic()
    runs = measure(opts.quick, opts.repeat)
    table = report(runs, time.monotonic() - t0)
    if opts.json:
        Path(opts.json).write_text(json.dumps({"runs": runs, "medians": table}, indent=1))


if __name__ == "__main__":
    main()
