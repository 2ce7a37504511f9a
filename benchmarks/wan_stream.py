"""vpool streaming across a wide-area delay, next to plain TCP through the same delay line.

    .venv/bin/python benchmarks/wan_stream.py [--delay MS|direct ...] [--rate MIBPS ...]
        [--bytes 1G] [--size 16M] [--windows fixed growing] [--json FILE]

A local pool (``vsdk local up``: 2 agents of one slot, 1 relay) whose relay sits behind a
user-space delay line (benchmarks/delayline.py): the relay listens on 127.0.0.2:P and
advertises 127.0.0.1:P, where the line listens and forwards to it, ``delay`` later each way
(its TLS certificate names 127.0.0.1, which is what the agents ask for). Every agent <-> relay
connection goes through the line, so a message crosses it twice: rank 0 -> agent A -> line ->
relay (logged, acknowledged) -> line -> agent B -> rank 1, and every Credit and Ack comes back
through it.

A two-rank mpi4py program streams ``--bytes`` in ``--size`` messages (non-blocking sends, at
most 64 MiB outstanding, as benchmarks/programs/mpi_bench.py does), twice: ``cold`` right after
the ranks start (the push window starts at push_window), then ``warm``; each from a barrier to
the receiver's acknowledgement. The baseline is one plain TCP stream of the same bytes through a
line of the same delay and rate (``delayline.measure_plain``). ``--rate`` gives the lines a
bottleneck (MiB/s), as a real link has, with a buffer of twice rate x delay; rate 0 is a line
that carries what its threads can copy (about 1 GiB/s here, far beyond what the pool streams on
two cores, so there the ratio says how the pool compares with the machine, not with the link).
Each delay runs with each rate (default: none and 100 MiB/s).

``--windows``: ``fixed`` runs the relay with push_window_max 0, at most push_window (the window
as it was before it grew), ``growing`` with the default. ``direct`` as a delay: no line at all (the
pool as `vsdk local up` makes it; the plain TCP figure is then a 0 ms line's).

Prints, per delay, rate and window: plain TCP MiB/s, vpool cold and warm MiB/s, and warm /
plain. Target (issue 19, 5c): at 20 ms, vpool warm >= 0.5 x plain TCP.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import delayline  # noqa: E402

from vpool.sdk import localpool  # noqa: E402

BIN = Path(sys.executable).parent
MiB = 1024 * 1024
RELAY_HOST = "127.0.0.2"  # where the relay listens when a line stands in front of it
TIMEOUT = 900

PROGRAM = '''\
"""Two ranks: rank 0 streams to rank 1, cold then warm; rank 0 prints the MiB/s as JSON."""
import json
import sys

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
size, total = int(sys.argv[1]), int(sys.argv[2])
buf = np.ones(size, dtype=np.uint8)
ack = np.zeros(1, dtype=np.uint8)
window = max(1, min(64, (64 << 20) // size))  # outstanding Isends, like osu_bw


def stream(count):
    comm.Barrier()
    t0 = MPI.Wtime()
    done = 0
    while done < count:
        k = min(window, count - done)
        if rank == 0:
            MPI.Request.Waitall([comm.Isend(buf, dest=1, tag=2) for _ in range(k)])
        else:
            MPI.Request.Waitall([comm.Irecv(buf, source=0, tag=2) for _ in range(k)])
        done += k
    if rank == 0:
        comm.Recv(ack, source=1, tag=3)
    else:
        comm.Send(ack, dest=0, tag=3)
    return count * size / (MPI.Wtime() - t0) / 2**20


count = max(4, total // size)
cold = stream(count)
warm = stream(count)
if rank == 0:
    print(json.dumps({"cold": cold, "warm": warm}), flush=True)
'''


def _last_json(text: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(
        [line for line in text.splitlines() if line.startswith("{")][-1]
    )
    return found


@contextlib.contextmanager
def line_pool(
    delay: float | None,
    work: Path,
    *,
    rate: float | None = None,
    relay_options: dict[str, object] | None = None,
) -> Iterator[tuple[dict[str, str], delayline.DelayLine | None]]:
    """A local pool (2 agents of one slot, 1 relay) in a new VPOOL_HOME under ``work``, its
    relay behind a line of ``delay`` s and ``rate`` bytes/s (no line if ``delay`` is None).
    Yields the environment for ``vsdk`` and the line; stops both whatever happens."""
    home = Path(tempfile.mkdtemp(prefix="vpool-wan-", dir=work))
    old_home = os.environ.get("VPOOL_HOME")
    os.environ["VPOOL_HOME"] = str(home)
    options = dict(relay_options or {})
    if delay is not None:
        options["host"] = RELAY_HOST
    line: delayline.DelayLine | None = None
    try:
        localpool.up(agents=2, relays=1, slots=1, fresh=True, relay_options=options)
        try:
            if delay is not None:
                ready = json.loads(localpool.layout().ready_file("relay-0").read_text())
                port = int(ready["port"])
                line = delayline.DelayLine((RELAY_HOST, port), delay, port=port, rate=rate)
            yield {**os.environ}, line
        finally:
            if line is not None:
                line.close()
            localpool.down()
    finally:
        if old_home is None:
            os.environ.pop("VPOOL_HOME", None)
        else:
            os.environ["VPOOL_HOME"] = old_home


Vsdk = Callable[..., str]


def vsdk_in(env: dict[str, str]) -> Vsdk:
    """``vsdk`` with ``env`` (a local pool's VPOOL_HOME): it returns what the command printed,
    and raises RuntimeError if it failed."""

    def vsdk(*args: object) -> str:
        argv = [str(BIN / "vsdk"), *map(str, args)]
        out = subprocess.run(
            argv, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False
        )
        if out.returncode != 0:
            raise RuntimeError(
                f"{shlex.join(argv[1:])} failed ({out.returncode}):\n{out.stderr[-3000:]}"
            )
        return out.stdout

    return vsdk


def stream_job(vsdk: Vsdk, work: Path, size: int, nbytes: int) -> dict[str, Any]:
    """Submit PROGRAM with ``vsdk`` at 2 ranks; its cold and warm MiB/s."""
    program = work / "wan_stream_ranks.py"
    program.write_text(PROGRAM)
    out = vsdk("submit", program, "--ranks", "2", "--wait", "--", size, nbytes)
    return _last_json(out)


def run_pool(
    delay: float | None, window: str, size: int, nbytes: int, work: Path, rate: float | None
) -> dict[str, Any]:
    """Start a pool (its relay behind a line of ``delay`` s and ``rate`` bytes/s, or none),
    stream, stop it."""
    options: dict[str, object] = {}
    if window == "fixed":
        options["push_window_max"] = 0  # at most push_window: the window stays fixed
    with line_pool(delay, work, rate=rate, relay_options=options) as (env, line):
        res = stream_job(vsdk_in(env), work, size, nbytes)
        if line is not None:
            res["line_bytes"] = line.forwarded
        return res


def _size(text: str) -> int:
    return delayline._size(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--delay", nargs="+", default=["20", "0", "direct"], help="ms each way, or 'direct'"
    )
    ap.add_argument(
        "--rate",
        type=float,
        nargs="+",
        default=[0.0, 100.0],
        help="the lines' bottleneck in MiB/s, 0: none (each delay runs with each rate)",
    )
    ap.add_argument("--bytes", default="1G", help="bytes per stream (1G, 512M)")
    ap.add_argument("--size", default="16M", help="message size")
    ap.add_argument(
        "--windows", nargs="+", default=["fixed", "growing"], choices=["fixed", "growing"]
    )
    ap.add_argument("--json", default="", help="also write every figure to this JSON file")
    opts = ap.parse_args()
    nbytes, size = _size(opts.bytes), _size(opts.size)
    configs = [
        (d, r) for d in opts.delay for r in ([0.0] if d == "direct" else sorted(set(opts.rate)))
    ]
    t0 = time.monotonic()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="wan-stream-") as tmp:
        work = Path(tmp)
        for d, mibps in configs:
            delay = None if d == "direct" else float(d) / 1000
            rate = mibps * MiB if mibps else None
            plain = delayline.measure_plain(delay or 0.0, nbytes, rate=rate)
            for window in opts.windows:
                res = run_pool(delay, window, size, nbytes, work, rate)
                rows.append({"delay": d, "rate": mibps, "window": window, "plain": plain, **res})
                print(
                    f"  {d:>6} {mibps:5g} {window:8} plain {plain:7.0f}  vpool cold "
                    f"{res['cold']:6.0f}  warm {res['warm']:6.0f} MiB/s",
                    file=sys.stderr,
                    flush=True,
                )
    elapsed = time.monotonic() - t0
    print(
        f"\nwan_stream: {elapsed:.0f} s; {size // MiB} MiB messages, {nbytes / MiB:.0f} MiB "
        "per stream, MiB/s; ratio = vpool warm / plain TCP through the same line"
    )
    head = ("delay", "link", "window", "plain TCP", "vpool cold", "vpool warm", "ratio")
    print("{:>8} {:>10} {:>8} {:>10} {:>11} {:>11} {:>7}".format(*head))
    for r in rows:
        direct = r["delay"] == "direct"
        label = "no line" if direct else f"{r['delay']} ms"
        link = "-" if direct else f"{r['rate']:g} MiB/s" if r["rate"] else "unlimited"
        print(
            f"{label:>8} {link:>10} {r['window']:>8} {r['plain']:10.0f} {r['cold']:11.0f}"
            f" {r['warm']:11.0f} {r['warm'] / r['plain']:6.2f}x"
        )
    for r in rows:
        if r["delay"] == "20" and r["window"] == "growing":
            ok = r["warm"] >= 0.5 * r["plain"]
            link = f"{r['rate']:g} MiB/s line" if r["rate"] else "unlimited line"
            print(
                f"target (5c) at 20 ms, {link}, vpool >= 0.5 x plain TCP: {r['warm']:.0f} vs "
                f"{r['plain']:.0f} MiB/s = {r['warm'] / r['plain']:.2f}x -> "
                f"{'HOLDS' if ok else 'MISSED'}"
            )
    if opts.json:
        Path(opts.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
