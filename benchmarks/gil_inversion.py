"""Why checkpoint chores run in niced processes, not niced threads: priority inversion on the GIL.

    .venv/bin/python benchmarks/gil_inversion.py [--seconds 15] [--hogs 3] [--json FILE]

A loop stands for an agent's (or relay's) event loop on the ranks' message path: every
millisecond it wakes up and runs a little Python (forwarding a frame). Beside it run ``--hogs``
busy processes at the same priority (the ranks, keeping every core busy) and, depending on
the mode, the packing of a checkpoint (AES-GCM of 1 MiB, SHA-256 of it, some Python glue per
chunk, as ``ckpt_image`` does) at niceness 19:

- ``none``: no packing (the baseline);
- ``thread``: the packing in a niced thread of the loop's own process (how the agent and the
  relay's store did it);
- ``process``: the packing in a niced process of its own (``worker_agent/ckpt_worker.py``).

For each mode it prints how late the loop's wake-ups were (median, 99th and 99.9th
percentile, worst) and the sum of the lateness beyond 5 ms, and that sum as a ratio to the
baseline's. The heavy C calls release the GIL, but the niced thread still holds it while it
runs the glue between them; when the scheduler preempts it there, which at niceness 19 on busy
cores it does, the loop waits for the GIL until the niced thread runs again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

PACKER = r"""
import hashlib, os, sys, threading
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

def pack(stop):
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    aead, data, nonce = AESGCM(bytes(32)), os.urandom(1 << 20), os.urandom(12)
    while stop is None or not stop.is_set():
        sealed = aead.encrypt(nonce, data, b"aad")
        hashlib.sha256(sealed).digest()
        glue = 0
        for i in range(2000):  # the Python between two C calls: headers, bookkeeping
            glue += i

if __name__ == "__main__":
    pack(None)
"""

HOG = "while True: pass"


def loop_lateness(seconds: float) -> list[float]:
    late: list[float] = []
    end = time.monotonic() + seconds
    due = time.monotonic()
    while time.monotonic() < end:
        due += 0.001
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        now = time.monotonic()
        late.append(now - due)
        sum(range(300))  # a little Python, as forwarding a frame takes
        due = max(due, now)
    return late


def run_mode(mode: str, seconds: float, hogs: int) -> dict[str, float]:
    started: list[subprocess.Popen[bytes]] = []
    stop = threading.Event()
    namespace: dict[str, object] = {}
    exec(compile(PACKER, "<packer>", "exec"), namespace)
    try:
        started += [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(hogs)]
        if mode == "thread":
            threading.Thread(target=namespace["pack"], args=(stop,), daemon=True).start()
        elif mode == "process":
            started.append(subprocess.Popen([sys.executable, "-c", PACKER]))
        late = loop_lateness(seconds)
    finally:
        stop.set()
        for proc in started:  # only what this run started, by its pid
            proc.kill()
            proc.wait()
    late.sort()

    def q(p: float) -> float:
        return late[int(p * (len(late) - 1))] * 1000

    return {
        "wakeups": len(late),
        "p50_ms": q(0.5),
        "p99_ms": q(0.99),
        "p999_ms": q(0.999),
        "max_ms": late[-1] * 1000,
        "over_5ms_s": sum(x for x in late if x > 0.005),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=15.0, help="per mode")
    ap.add_argument("--hogs", type=int, default=(os.cpu_count() or 2) + 1)
    ap.add_argument("--json", default="")
    opts = ap.parse_args()
    results = {}
    for mode in ("none", "thread", "process"):
        results[mode] = run_mode(mode, opts.seconds, opts.hogs)
    base = max(results["none"]["over_5ms_s"], 1e-3)
    print(
        f"\ngil_inversion: a 1 ms loop beside {opts.hogs} busy processes, {opts.seconds:g} s "
        "per mode; packing at niceness 19"
    )
    print("mode      wakeups   p50 ms   p99 ms  p99.9 ms   max ms   late>5ms s  vs none")
    for mode, r in results.items():
        print(
            f"{mode:8} {r['wakeups']:8d} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} "
            f"{r['p999_ms']:9.2f} {r['max_ms']:8.1f} {r['over_5ms_s']:12.2f} "
            f"{r['over_5ms_s'] / base:7.2f}x"
        )
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"options": vars(opts), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
