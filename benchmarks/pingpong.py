"""Round trip (64 B, 1 MiB) and streaming bandwidth through a local vpool pool, next to a bare trio
store-and-forward relay measured in the same run, printed as ratios.

    .venv/bin/python benchmarks/pingpong.py [--quick] [--json]

vpool's path: rank 0 -> agent -> relay (log on disk, TLS) -> agent -> rank 1, ranks 0 and 1 on
different agents with different home relays (a local pool of 3 agents and 2 relays). The bare relay
(benchmarks/bare_relay.py) does store-and-forward over TLS between two client processes and
nothing else. Also measured, when available: `vsdk mpiexec` (in-process router, no TLS, no log).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bare_relay  # noqa: E402

VSDK = str(Path(sys.executable).parent / "vsdk")
PROGRAM = str(HERE / "programs" / "pingpong.py")


def _vsdk(env: dict[str, str], *args: str, timeout: float = 600) -> str:
    out = subprocess.run(
        [VSDK, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"vsdk {' '.join(args)} failed ({out.returncode}):\n{out.stderr}")
    return out.stdout


def _last_json(text: str) -> dict[str, float]:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def measure_pool(iters: tuple[int, int, int]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="vpool-bench-") as home:
        env = {**os.environ, "VPOOL_HOME": home}
        _vsdk(env, "local", "up", "--agents", "3", "--relays", "2")
        try:
            args = ["--", *map(str, iters)]
            return _last_json(_vsdk(env, "submit", PROGRAM, "--ranks", "2", "--wait", *args))
        finally:
            _vsdk(env, "local", "down")


def measure_mpiexec(iters: tuple[int, int, int]) -> dict[str, float] | None:
    try:
        out = _vsdk(dict(os.environ), "mpiexec", "-n", "2", PROGRAM, *map(str, iters))
    except RuntimeError as exc:
        print(f"(vsdk mpiexec not measured: {exc})", file=sys.stderr)
        return None
    return _last_json(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    opts = ap.parse_args()
    iters = (300, 10, 40) if opts.quick else (2000, 50, 200)
    rows = {"bare trio relay (TLS)": bare_relay.measure(iters)}
    rows["vpool local pool"] = measure_pool(iters)
    mpiexec = measure_mpiexec(iters)
    if mpiexec is not None:
        rows["vsdk mpiexec"] = mpiexec
    if opts.json:
        print(json.dumps(rows))
        return
    base = rows["bare trio relay (TLS)"]
    print(f"{'':26} {'rtt 64 B':>14} {'rtt 1 MiB':>14} {'stream 1 MiB':>16}")
    for name, r in rows.items():
        print(
            f"{name:26} {r['rtt_64'] * 1e3:9.3f} ms {'':3} {r['rtt_1m'] * 1e3:9.3f} ms {'':3}"
            f"{r['bw_mib']:9.1f} MiB/s"
        )
    for name, r in rows.items():
        if r is base:
            continue
        print(
            f"{name + ' / bare':26} {r['rtt_64'] / base['rtt_64']:11.2f}x {'':3}"
            f"{r['rtt_1m'] / base['rtt_1m']:11.2f}x {'':3}{r['bw_mib'] / base['bw_mib']:13.2f}x"
            "  (rtt: lower is better; bandwidth: higher is better)"
        )


if __name__ == "__main__":
    main()
