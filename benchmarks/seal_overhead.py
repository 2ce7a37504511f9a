"""What sealing messages for the relays costs: the same benchmarks with it on and off.

    .venv/bin/python benchmarks/seal_overhead.py [--quick] [--repeat N] [--json FILE]

Issue 20 asks for encryption's cost on 16 MiB streaming and the 8 B round trip, against
encryption off, in one run (goal: under 5%). This starts a local pool (``vsdk local up
--agents 2 --relays 1`` in a temporary VPOOL_HOME, stopped at the end whatever happens) and
submits the unmodified program benchmarks/programs/mpi_bench.py at 2 ranks (one per agent:
every message crosses the relay, sealed by the sending agent and opened by the receiving one)
and at 4 ranks (collectives). Between the "on" and "off" runs both agents are restarted with
``seal_messages`` switched in their config files (the agent logs a warning when it is off;
the run checks it did). Pairs alternate in order (on, off / off, on, ...) and each figure is
the median over ``--repeat`` pairs (default 3), as in ``ft_overhead.py``, whose table this
prints.
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from ft_overhead import VSDK, Results, _run, report, run_job  # noqa: E402

AGENTS = ("agent-0", "agent-1")
OFF_WARNING = "seal_messages is off"


def _switch(env: dict[str, str], home: Path, on: bool) -> None:
    """Restart both agents with ``seal_messages = on`` and check they took it."""
    pool = home / "state" / "local-pool"
    for name in AGENTS:
        config = pool / name / "config.toml"
        lines = [
            line for line in config.read_text().splitlines() if not line.startswith("seal_messages")
        ]
        config.write_text("\n".join([*lines, f"seal_messages = {str(on).lower()}", ""]))
        log = pool / "logs" / f"{name}.log"
        _stop(pool, name)
        log.write_text("")  # the restarted agent's lines only
        _run([VSDK, "local", "restart", name], env, 120)
        if (OFF_WARNING in log.read_text()) == on:
            raise RuntimeError(f"{name} did not switch seal_messages to {on}")


def _stop(pool: Path, name: str) -> None:
    """SIGTERM the pool's agent ``name`` (started by this run's `vsdk local up`) and wait
    until it is gone."""
    [pid] = [p["pid"] for p in json.loads((pool / "pids.json").read_text()) if p["name"] == name]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{pid}").exists():
        stat = Path(f"/proc/{pid}/stat").read_text(errors="replace")
        if stat.rsplit(") ", 1)[-1].startswith("Z"):
            break  # exited; `vsdk local` reaps it
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} (pid {pid}) did not stop within 60 s")
        time.sleep(0.05)


def measure(quick: bool, repeat: int, sizes: tuple[int, ...] = (2, 4)) -> dict[str, list[Results]]:
    runs: dict[str, list[Results]] = {"on": [], "off": []}
    with tempfile.TemporaryDirectory(prefix="vpool-seal-bench-") as home:
        env = {**os.environ, "VPOOL_HOME": home}
        _run([VSDK, "local", "up", "--agents", "2", "--relays", "1"], env, 120)
        try:
            for i in range(repeat):
                for on in (True, False) if i % 2 == 0 else (False, True):
                    _switch(env, Path(home), on)
                    key = "on" if on else "off"
                    res: Results = {}
                    for n in sizes:
                        res[n] = run_job(env, n, True, quick, f"seal-{key}-n{n}-{i}")
                        print(f"  seal {key} n={n} run {i}: done", file=sys.stderr, flush=True)
                    runs[key].append(res)
        finally:
            _run([VSDK, "local", "down"], env, 120)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    ap.add_argument("--repeat", type=int, default=3, help="on/off pairs; figures are medians")
    ap.add_argument("--json", default="", help="also write every run and the medians here")
    opts = ap.parse_args()
    if opts.repeat < 1:
        ap.error("--repeat must be at least 1")
    t0 = time.monotonic()
    runs = measure(opts.quick, opts.repeat)
    table = report(runs, time.monotonic() - t0, title="seal_overhead", what="seal", cost="sealing")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"runs": runs, "medians": table}, indent=1))


if __name__ == "__main__":
    main()
