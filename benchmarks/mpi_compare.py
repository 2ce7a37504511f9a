"""vpool next to real MPI over TCP and next to a bare trio relay, in one run, printed as ratios.

    .venv/bin/python benchmarks/mpi_compare.py [--quick] [--json FILE] [--skip NAME ...]

One unmodified mpi4py program (benchmarks/programs/mpi_bench.py) runs under three launchers:

- ``mpich-tcp``: MPICH's ``mpiexec`` with the real mpi4py, forced onto TCP (ch4:ucx with
  ``UCX_TLS=tcp,self`` and ``MPIR_CVAR_NOLOCAL=1``, so not even ranks on one host use shared
  memory; the run checks UCX's endpoint report says tcp). Installed with apt-get / pip when missing.
- ``vsdk-mpiexec``: vpool's in-process router (no TLS, no log, one process per rank).
- ``vpool-pool``: a local pool (``vsdk local up``, 4 agents with one slot each, 2 relays, in a
  temporary VPOOL_HOME): rank -> agent -> relay (TLS, log on disk) -> agent -> rank, every rank
  on its own agent.
- ``vpool-1agent``: a local pool of one agent with 4 slots and 2 relays: every rank on one
  agent, so a message goes rank -> agent -> rank (agent-local delivery) and is still logged
  at its receiver's home relay.

and the baseline, ``bare-relay``: benchmarks/bare_relay.py, a trio TLS store-and-forward relay
between two client processes (round trips and streaming only).

Figures: round trip per size (8 B .. 16 MiB), streaming bandwidth (64 KiB, 1 MiB, 16 MiB
messages), ``Allreduce`` of 8 doubles and ``Barrier`` at 2 and 4 ranks. Then the message
path's targets, against the bare relay: an 8 B round trip between ranks on one agent at most 1x
and between ranks on two agents at most 3x; 16 MiB streaming at least 1x; an ``Allreduce`` of 8
doubles at 4 ranks on one agent within 1.5 x 4 bare 8 B round trips.

``--quick`` (a smoke run, under 2 minutes) measures fewer sizes with fewer iterations.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bare_relay  # noqa: E402

BIN = Path(sys.executable).parent
PROGRAM = str(HERE / "programs" / "mpi_bench.py")
LAUNCHERS = ("mpich-tcp", "vsdk-mpiexec", "vpool-pool", "vpool-1agent")
# The local pools: every rank on its own agent; every rank on one agent (agent-local delivery).
POOLS = ("vpool-pool", "vpool-1agent")
SHORT = {"vpool-pool": "pool", "vpool-1agent": "1agent"}
POOL_LAYOUT = {"vpool-pool": ("4", "1"), "vpool-1agent": ("1", "4")}  # agents, slots
# MPICH (ch4:ucx in Debian) on TCP only: UCX may use nothing but TCP (and "self" for a rank's
# messages to itself), and MPICH's own shared-memory path between local ranks is off.
MPICH_TCP_ENV = {"UCX_TLS": "tcp,self", "MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH3_NOLOCAL": "1"}
TIMEOUT = 900


class Skipped(Exception):
    pass


def _run(cmd: list[str], env: dict[str, str], timeout: float = TIMEOUT) -> str:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out.stdout + "\n" + out.stderr


def _last_json(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def _program_args(quick: bool, nranks: int) -> list[str]:
    args = ["--quick"] if quick else []
    return args if nranks == 2 else [*args, "--no-p2p"]


# -- real MPI --------------------------------------------------------------------------------


def _plain_env() -> dict[str, str]:
    """The environment without anything that would put vpool's mpi4py shim first."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def _has_real_mpi() -> bool:
    if shutil.which("mpiexec") is None:
        return False
    probe = [sys.executable, "-c", "from mpi4py import MPI; print(MPI.Get_library_version())"]
    out = subprocess.run(probe, env=_plain_env(), capture_output=True, text=True, check=False)
    return out.returncode == 0 and "MPICH" in out.stdout


def ensure_real_mpi() -> None:
    """Install MPICH and an mpi4py built against it when they are missing."""
    if _has_real_mpi():
        return
    if shutil.which("mpiexec") is None:
        sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
        print("installing MPICH with apt-get ...", file=sys.stderr)
        for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "mpich", "libmpich-dev"]):
            subprocess.run([*sudo, *cmd], check=False, capture_output=True)
    if shutil.which("mpiexec") is not None and not _has_real_mpi():
        print("installing mpi4py (built against MPICH) with pip ...", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-binary", "mpi4py", "mpi4py"],
            env={**_plain_env(), "MPICC": "mpicc"},
            check=False,
            capture_output=True,
        )
    if not _has_real_mpi():
        raise Skipped("no MPICH with a real mpi4py (apt-get/pip install failed)")


def run_mpich(nranks: int, quick: bool) -> dict:
    env = {**_plain_env(), **MPICH_TCP_ENV, "UCX_LOG_LEVEL": "info"}
    cmd = ["mpiexec", "-n", str(nranks), sys.executable, PROGRAM, *_program_args(quick, nranks)]
    text = _run(cmd, env)
    endpoints = [line for line in text.splitlines() if "ep_cfg" in line]
    # Each rank reports its endpoints: to itself (self/memory) and to its peers (tcp only).
    bad = [e for e in endpoints if any(t in e for t in ("posix", "sysv", "cma", "knem", "xpmem"))]
    if not endpoints or bad or not all("tcp/" in e or "self/" in e for e in endpoints):
        raise RuntimeError("MPICH did not run on TCP only:\n" + "\n".join(endpoints or [text]))
    return _last_json(text)


# -- vpool -----------------------------------------------------------------------------------


def run_vsdk_mpiexec(nranks: int, quick: bool) -> dict:
    cmd = [str(BIN / "vsdk"), "mpiexec", "-n", str(nranks), "--", PROGRAM]
    return _last_json(_run([*cmd, *_program_args(quick, nranks)], dict(os.environ)))


def run_pool(layout: str, sizes: list[int], quick: bool) -> dict[int, dict]:
    results: dict[int, dict] = {}
    vsdk = str(BIN / "vsdk")
    agents, slots = POOL_LAYOUT[layout]
    with tempfile.TemporaryDirectory(prefix="vpool-bench-") as home:
        env = {**os.environ, "VPOOL_HOME": home}
        up = ["local", "up", "--agents", agents, "--relays", "2", "--slots", slots]
        _run([vsdk, *up], env, 120)
        try:
            for n in sizes:
                cmd = [vsdk, "submit", PROGRAM, "--ranks", str(n), "--wait", "--"]
                results[n] = _last_json(_run([*cmd, *_program_args(quick, n)], env))
        finally:
            _run([vsdk, "local", "down"], env, 120)
    return results


# -- report ----------------------------------------------------------------------------------


def _size(n: int) -> str:
    for unit, k in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= k:
            return f"{n // k} {unit}"
    return f"{n} B"


def _t(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e6:.0f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def report(res: dict[str, dict], elapsed: float) -> dict[str, object]:
    cols = [c for c in ("bare-relay", *LAUNCHERS) if c in res]
    base = res.get("bare-relay")
    pools = [c for c in POOLS if c in res]
    w = 14

    def row(label: str, cells: list[str]) -> None:
        print(f"{label:24}" + "".join(f"{c:>{w}}" for c in cells))

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.2f}x" if a and b else "-"

    extra = [f"{SHORT[c]}/bare" for c in pools] + [f"{SHORT[c]}/mpich" for c in pools]
    print(f"\nmpi_compare: {elapsed:.0f} s; times are per operation, bandwidth in MiB/s")
    row("", [*cols, *extra])
    two = {c: res[c].get(2, {}) for c in cols}

    def ratios(vals: dict[str, float | None], *, vs_bare: bool = True) -> list[str]:
        bare = [ratio(vals.get(c), vals.get("bare-relay")) if vs_bare else "" for c in pools]
        return bare + [ratio(vals.get(c), vals.get("mpich-tcp")) for c in pools]

    sizes = sorted({int(s) for c in cols for s in two[c].get("rtt", {})})
    for s in sizes:
        vals = {c: two[c].get("rtt", {}).get(str(s)) for c in cols}
        row(f"round trip {_size(s)}", [_t(vals[c]) for c in cols] + ratios(vals))
    sizes = sorted({int(s) for c in cols for s in two[c].get("bw", {})})
    for s in sizes:
        vals = {c: two[c].get("bw", {}).get(str(s)) for c in cols}
        row(
            f"stream {_size(s)}",
            [f"{vals[c]:.0f}" if vals[c] else "-" for c in cols] + ratios(vals),
        )
    for what in ("allreduce_8d", "barrier"):
        for n in (2, 4):
            vals = {c: res[c].get(n, {}).get(what) for c in cols}
            label = "allreduce 8 doubles" if what == "allreduce_8d" else "barrier"
            row(f"{label} n={n}", [_t(vals[c]) for c in cols] + ratios(vals, vs_bare=False))
    print("(round trips and collectives: lower is better; streaming: higher is better)")
    return _targets(res, base) if base else {}


def _targets(res: dict[str, dict], base: dict) -> dict[str, object]:
    """The message path's targets, against the bare relay of this run."""
    b = base[2]
    rtt8, bw16 = b["rtt"].get("8"), b["bw"].get(str(16 * 2**20))
    targets: dict[str, object] = {}

    def check(name: str, text: str, value: float | None, bound: float | None, *, most: bool):
        if not value or not bound:
            return
        ok = value <= bound if most else value >= bound
        targets[name] = {"value": value, "bound": bound, "ok": ok}
        print(f"target {text}: {value:.6g} vs {bound:.6g} -> {'HOLDS' if ok else 'MISSED'}")

    one, many = res.get("vpool-1agent", {}), res.get("vpool-pool", {})
    rt_one = one.get(2, {}).get("rtt", {}).get("8")
    rt_many = many.get(2, {}).get("rtt", {}).get("8")
    check(
        "rtt8_one_agent",
        "round trip 8 B, ranks on one agent <= 1 x bare (s)",
        rt_one,
        rtt8,
        most=True,
    )
    check(
        "rtt8_two_agents",
        "round trip 8 B, ranks on two agents <= 3 x bare (s)",
        rt_many,
        3 * rtt8 if rtt8 else None,
        most=True,
    )
    for col, label in (("vpool-1agent", "one agent"), ("vpool-pool", "two agents")):
        bw = res.get(col, {}).get(2, {}).get("bw", {}).get(str(16 * 2**20))
        check(
            f"stream16_{SHORT[col]}",
            f"16 MiB streaming, {label} >= 1 x bare (MiB/s)",
            bw,
            bw16,
            most=False,
        )
    ar = one.get(4, {}).get("allreduce_8d")
    check(
        "allreduce4_one_agent",
        "allreduce 8 doubles n=4 on one agent <= 1.5 x 4 bare 8 B round trips (s)",
        ar,
        6 * rtt8 if rtt8 else None,
        most=True,
    )
    return targets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer sizes and iterations (< 2 min)")
    ap.add_argument("--json", default="", help="also write every figure to this JSON file")
    ap.add_argument(
        "--skip", nargs="*", default=[], choices=["bare-relay", *LAUNCHERS], help="leave out"
    )
    opts = ap.parse_args()
    t0 = time.monotonic()
    res: dict[str, dict] = {}
    if "bare-relay" not in opts.skip:
        res["bare-relay"] = {2: bare_relay.measure_sweep(opts.quick)}
    if "mpich-tcp" not in opts.skip:
        try:
            ensure_real_mpi()
            res["mpich-tcp"] = {n: run_mpich(n, opts.quick) for n in (2, 4)}
        except Skipped as exc:
            print(f"(mpich-tcp not measured: {exc})", file=sys.stderr)
    if "vsdk-mpiexec" not in opts.skip:
        res["vsdk-mpiexec"] = {n: run_vsdk_mpiexec(n, opts.quick) for n in (2, 4)}
    for layout in POOLS:
        if layout not in opts.skip:
            res[layout] = run_pool(layout, [2, 4], opts.quick)
    targets = report(res, time.monotonic() - t0)
    if opts.json:
        Path(opts.json).write_text(json.dumps({"results": res, "targets": targets}, indent=1))


if __name__ == "__main__":
    main()
