"""WAN figures: round trip, streaming and examples/heat.py through a delay line, next to plain TCP.

    .venv/bin/python benchmarks/wan_pool.py [--local] [--no-fsync] [--delay MS ...] [--quick]
        [--json FILE]

By default (root only) the pool is the multi-host test's, on network namespaces
(benchmarks/wan_netns.py, tests/integration/netpool.py): a coordinator, relay-0, volunteers
agent-0 and agent-1 of one slot each behind firewalls that drop every new inbound connection,
and the user's machine, on one bridge, set up with the operator's commands; a user-space delay
line (benchmarks/delayline.py, this kernel has no netem) of ``delay`` ms each way runs on
relay-0's machine, on the address the relay's bundle advertises, in front of the relay. The
relay runs its bundle's settings, so it writes every message to its disk before acknowledging
it (``fsync = true``); ``--no-fsync`` turns that off, as the local pool has it. Without
root, ``ip``, ``nft``, ``nsenter`` or ``ss``, or where namespaces cannot be made, it says why
and exits with 77 (skipped). Every namespace and process it made is removed on the way out,
failure, Ctrl-C and SIGTERM included.

``--local``: benchmarks/wan_stream.py's topology instead (``wan_stream.line_pool``): a local
pool (`vsdk local up`, 127.0.0.1) of 2 agents of one slot and 1 relay, in a private VPOOL_HOME,
the line in this process in front of the relay.

Either way the two ranks of every job land on different agents, so every message takes rank ->
agent -> line -> relay -> line -> agent -> rank: it crosses the line twice, and a round trip
four times (at least 4 x delay), where a plain TCP round trip through the same line crosses it
twice (2 x delay). A pool with no line at all ("direct", always measured first) is the
baseline for heat.py. Each row is a pool of its own (namespaces and all), made and removed.

For each delay:

1. Round trip of 8 B between the two ranks: each timed alone, the median of ``--iters`` after
   ``--iters / 10`` warm-up ones. Plain TCP: an 8 B echo through a line of the same delay,
   timed the same way, before the pool starts (namespaces: from agent-0's machine to an echo
   on relay-0's, through the same line process; local: in this process, as the line is).
2. Streaming: wan_stream.py's program (``--bytes`` in ``--size`` messages, cold then warm; the
   table shows warm) next to one plain TCP stream of the same bytes through a line of the same
   delay (namespaces: agent-0 to a sink on relay-0's machine through the same line; local:
   ``delayline.measure_plain``). ``--rate`` gives every line a bottleneck (MiB/s, with
   wan_stream.py's buffer); by default a line carries what its threads copy, far more than the
   pool streams on two cores.
3. examples/heat.py ``--steps`` steps of ``--cells`` cells per rank on 2 ranks: the job's time
   from created to finished on the coordinator's clock, median of ``--repeat``, and its ratio to
   the same with no line. Every run must print the same checksum. Each heat.py step waits for
   one halo message each way, so a step costs about one round trip.

The plain TCP figures of the "direct" row are shown as "-" (it has no line; the 0 ms row has a
line's).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import delayline  # noqa: E402
import wan_netns  # noqa: E402
import wan_stream  # noqa: E402
from wan_stream import Vsdk  # noqa: E402

from tests.integration import netpool  # noqa: E402

HEAT = str(HERE.parent / "examples" / "heat.py")
MiB = 1024 * 1024
RTT_SIZE = 8
SKIPPED = 77  # exit status: this machine cannot make the namespaces

RTT_PROGRAM = '''\
"""Two ranks: 8 B round trips from rank 0 to rank 1, each timed alone; rank 0 prints the
measured ones (after the warm-up) as JSON."""
import json
import sys
import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
iters, warmup = int(sys.argv[1]), int(sys.argv[2])
buf = np.zeros(8, dtype=np.uint8)
times = []
comm.Barrier()
for _ in range(warmup + iters):
    if rank == 0:
        # Not MPI.Wtime: vpool logs what it returns, and the next Send waits for the relay's
        # DetAck, one more trip through the line each way.
        t0 = time.perf_counter()
        comm.Send(buf, dest=1, tag=1)
        comm.Recv(buf, source=1, tag=1)
        times.append(time.perf_counter() - t0)
    else:
        comm.Recv(buf, source=0, tag=1)
        comm.Send(buf, dest=0, tag=1)
if rank == 0:
    print(json.dumps({"rtt": times[warmup:]}), flush=True)
'''


def stop_cleanly_on_sigterm() -> None:
    """SIGTERM (and SIGINT) end the run as Ctrl-C does, with KeyboardInterrupt: it is what
    ``localpool.up`` stops a half-started pool on (chaos.py's SystemExit would leave its
    processes running), and every ``finally`` then stops the pool and closes the lines."""

    def leave(signum: int, frame: object) -> None:
        # Once: a second signal would cut the cleanup short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, leave)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def plain_rtt(delay: float, iters: int, warmup: int) -> list[float]:
    """Seconds of each of ``iters`` 8 B round trips (after ``warmup``) from a client to an echo
    server through a line of ``delay`` s each way."""
    server = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    echoer = threading.Thread(target=echo, name="wan-pool-echo", daemon=True)
    echoer.start()
    times: list[float] = []
    msg = b"\x5a" * RTT_SIZE
    try:
        with (
            delayline.DelayLine(server.getsockname()[:2], delay) as line,
            socket.create_connection(("127.0.0.1", line.port)) as client,
        ):
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(warmup + iters):
                t0 = time.perf_counter()
                client.sendall(msg)
                got = 0
                while got < len(msg):
                    chunk = client.recv(len(msg) - got)
                    if not chunk:
                        raise RuntimeError("the echo through the line ended early")
                    got += len(chunk)
                times.append(time.perf_counter() - t0)
    finally:
        server.close()
        echoer.join(delayline.JOIN_TIMEOUT)
    return times[warmup:]


def rtt_job(vsdk: Vsdk, work: Path, iters: int, warmup: int) -> list[float]:
    program = work / "wan_pool_rtt.py"
    program.write_text(RTT_PROGRAM)
    out = vsdk("submit", program, "--ranks", "2", "--wait", "--quiet", "--", iters, warmup)
    times: list[float] = wan_stream._last_json(out)["rtt"]
    return times


def heat_job(vsdk: Vsdk, steps: int, cells: int, name: str) -> dict[str, Any]:
    """Run heat.py on 2 ranks; its checksum line, the job's created -> finished seconds and the
    submit's wall time."""
    t0 = time.monotonic()
    cmd = ["submit", HEAT, "--ranks", "2", "--name", name, "--wait", "--quiet", "--"]
    out = vsdk(*cmd, steps, cells)
    wall = time.monotonic() - t0
    [job] = [j for j in json.loads(vsdk("jobs", "--json")) if j["name"] == name]
    if job["state"] != "succeeded":
        raise RuntimeError(f"heat job {job['id']}: {json.dumps(job)}")
    checksum = [line for line in out.splitlines() if line.startswith("checksum")]
    if not checksum:
        raise RuntimeError(f"heat job {job['id']} printed no checksum:\n{out[-2000:]}")
    return {
        "job": job["id"],
        "job_s": job["finished"] - job["created"],
        "run_s": job["finished"] - job["started"],
        "wall_s": wall,
        "checksum": checksum[-1],
    }


def measure(label: str, opts: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Every figure of one row: ``label`` is a delay in ms or "direct" (no line)."""
    delay = None if label == "direct" else float(label) / 1000
    warmup = max(1, opts.iters // 10)
    row: dict[str, Any] = {"delay": label}

    def said_plain() -> None:
        _say(
            f"  {label} ms: plain TCP round trip {statistics.median(row['plain_rtt']) * 1e3:.2f}"
            f" ms, stream {row['plain_mibs']:.0f} MiB/s"
        )

    if opts.local:
        if delay is not None:
            row["plain_rtt"] = plain_rtt(delay, opts.iters, warmup)
            row["plain_mibs"] = delayline.measure_plain(delay, opts.nbytes, rate=opts.rate)
            said_plain()
        with wan_stream.line_pool(delay, work, rate=opts.rate) as (env, line):
            jobs(row, wan_stream.vsdk_in(env), opts, work)
            if line is not None:
                row["line_bytes"] = line.forwarded
        return row

    def plain(through: wan_netns.Plain) -> None:
        row["plain_rtt"] = through.rtt(opts.iters, warmup)
        row["plain_mibs"] = through.stream(opts.nbytes)
        said_plain()

    relay_env = {} if opts.fsync else {"VPOOL_RELAY_FSYNC": "false"}
    with wan_netns.line_pool(delay, work, rate=opts.rate, plain=plain, relay_env=relay_env) as vsdk:
        jobs(row, vsdk, opts, work)
    return row


def jobs(row: dict[str, Any], vsdk: Vsdk, opts: argparse.Namespace, work: Path) -> None:
    """The pool's figures of ``row``: round trip, streaming, heat.py."""
    label = row["delay"]
    row["rtt"] = rtt_job(vsdk, work, opts.iters, max(1, opts.iters // 10))
    row["stream"] = wan_stream.stream_job(vsdk, work, opts.size, opts.nbytes)
    _say(
        f"  {label}: vpool round trip {statistics.median(row['rtt']) * 1e3:.2f} ms, stream "
        f"cold {row['stream']['cold']:.0f} warm {row['stream']['warm']:.0f} MiB/s"
    )
    row["heat"] = []
    for i in range(opts.repeat):
        run = heat_job(vsdk, opts.steps, opts.cells, f"heat-{label}-{i}")
        row["heat"].append(run)
        _say(f"  {label}: heat.py #{i}: job {run['job']}, {run['job_s']:.2f} s")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def report(
    rows: list[dict[str, Any]], opts: argparse.Namespace, elapsed: float
) -> list[dict[str, Any]]:
    """Print the table (Markdown, as docs/notes.md keeps it); return its figures."""
    base = statistics.median(r["job_s"] for r in rows[0]["heat"])
    sums = {r["checksum"] for row in rows for r in row["heat"]}
    if len(sums) != 1:
        raise RuntimeError(f"heat.py printed different checksums: {sorted(sums)}")
    topology = (
        "local (127.0.0.1), the line in front of the relay"
        if opts.local
        else "network namespaces (coordinator, relay-0, agent-0 and agent-1 behind their "
        "firewalls, user), the line on relay-0's machine in front of the relay, "
        f"relay fsync {'on (its bundle)' if opts.fsync else 'off'}"
    )
    print(
        f"\nwan_pool: {elapsed:.0f} s. Pool: {topology}. "
        f"Round trip: {RTT_SIZE} B, median of {opts.iters}; "
        f"stream: {opts.nbytes / MiB:.0f} MiB in {opts.size / MiB:g} MiB messages (vpool warm), "
        f"lines {f'of {opts.rate / MiB:g} MiB/s' if opts.rate else 'with no bottleneck'}; "
        f"heat.py {opts.steps} steps x {opts.cells} cells on 2 ranks, created -> finished, "
        f"median of {opts.repeat}. Above N x delay: the round trip less the least it can take "
        "through the line (vpool's crosses it 4 times, plain TCP's twice)."
    )
    print(
        "\n| line (each way) | round trip vpool | above 4 x delay | plain TCP | above 2 x delay "
        "| stream vpool | plain TCP | vpool / plain | heat.py | / no line |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    figures = []
    for row in rows:
        direct = row["delay"] == "direct"
        delay = 0.0 if direct else float(row["delay"]) / 1000
        rtt = statistics.median(row["rtt"])
        heat = statistics.median(r["job_s"] for r in row["heat"])
        fig: dict[str, Any] = {
            "delay": row["delay"],
            "rtt_s": rtt,
            "stream_mibs": row["stream"]["warm"],
            "stream_cold_mibs": row["stream"]["cold"],
            "heat_s": heat,
            "heat_run_s": statistics.median(r["run_s"] for r in row["heat"]),
            "heat_ratio": heat / base,
        }
        cells = ["no line", _ms(rtt), "-", "-", "-", f"{fig['stream_mibs']:.0f} MiB/s", "-", "-"]
        if not direct:
            fig["plain_rtt_s"] = statistics.median(row["plain_rtt"])
            fig["plain_mibs"] = row["plain_mibs"]
            cells = [
                f"{row['delay']} ms",
                _ms(rtt),
                _ms(rtt - 4 * delay),
                _ms(fig["plain_rtt_s"]),
                _ms(fig["plain_rtt_s"] - 2 * delay),
                f"{fig['stream_mibs']:.0f} MiB/s",
                f"{fig['plain_mibs']:.0f} MiB/s",
                f"{fig['stream_mibs'] / fig['plain_mibs']:.2f}x",
            ]
        cells += [f"{heat:.2f} s", f"{heat / base:.2f}x"]
        figures.append(fig)
        print("| " + " | ".join(cells) + " |")
    print(f"heat.py checksum, every run: {sums.pop()}")
    return figures


def skip(why: str) -> NoReturn:
    _say(f"wan_pool: skipped: {why} (--local runs on 127.0.0.1 without namespaces)")
    sys.exit(SKIPPED)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--local", action="store_true", help="a local pool on 127.0.0.1 (no namespaces, no root)"
    )
    ap.add_argument(
        "--no-fsync",
        dest="fsync",
        action="store_false",
        help="the relay without its bundle's fsync = true, as the local pool runs it",
    )
    ap.add_argument("--delay", nargs="+", default=["0", "5", "20"], help="ms each way")
    ap.add_argument("--quick", action="store_true", help="smaller sizes, one repeat")
    ap.add_argument("--iters", type=int, default=0, help="round trips (default 100; quick 20)")
    ap.add_argument("--bytes", default="", help="bytes per stream (default 256M; quick 64M)")
    ap.add_argument("--size", default="16M", help="streaming message size")
    ap.add_argument(
        "--rate", type=float, default=0.0, help="the lines' bottleneck, MiB/s (0: none)"
    )
    ap.add_argument("--steps", type=int, default=0, help="heat.py steps (300; quick 100)")
    ap.add_argument("--cells", type=int, default=0, help="cells per rank (100000; quick 20000)")
    ap.add_argument("--repeat", type=int, default=0, help="heat.py runs per row (3; quick 1)")
    ap.add_argument("--json", default="", help="also write every measurement here")
    opts = ap.parse_args()
    opts.iters = opts.iters or (20 if opts.quick else 100)
    opts.nbytes = delayline._size(opts.bytes or ("64M" if opts.quick else "256M"))
    opts.size = delayline._size(opts.size)
    opts.rate = opts.rate * MiB if opts.rate > 0 else None
    opts.steps = opts.steps or (100 if opts.quick else 300)
    opts.cells = opts.cells or (20_000 if opts.quick else 100_000)
    opts.repeat = opts.repeat or (1 if opts.quick else 3)
    try:
        delays = [f"{float(d):g}" for d in opts.delay if d != "direct"]
    except ValueError:
        ap.error("--delay takes milliseconds (0, 5, 20)")
    if any(float(d) < 0 for d in delays) or min(opts.iters, opts.steps, opts.repeat) < 1:
        ap.error("need delays >= 0 and --iters, --steps, --repeat >= 1")
    why = "" if opts.local else netpool.cannot_run()
    if why:
        skip(why)
    print(f"command: .venv/bin/python benchmarks/wan_pool.py {shlex.join(sys.argv[1:])}")
    load = os.getloadavg()
    print(
        f"machine: {os.cpu_count()} cores, load average {load[0]:.2f} {load[1]:.2f} "
        f"{load[2]:.2f} at the start, Python {sys.version.split()[0]}",
        flush=True,
    )
    t0 = time.monotonic()
    rows = []
    with tempfile.TemporaryDirectory(prefix="wan-pool-") as tmp:
        for label in ["direct", *dict.fromkeys(delays)]:
            try:
                rows.append(measure(label, opts, Path(tmp)))
            except netpool.CannotRun as exc:
                skip(str(exc))
    figures = report(rows, opts, time.monotonic() - t0)
    load = os.getloadavg()
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if opts.json:
        out = {"argv": sys.argv[1:], "cores": os.cpu_count(), "figures": figures, "rows": rows}
        Path(opts.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    stop_cleanly_on_sigterm()
    try:
        main()
    except KeyboardInterrupt:
        _say("wan_pool: interrupted; the pool is stopped (and its namespaces removed)")
        sys.exit(130)
