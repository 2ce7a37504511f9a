"""What viewing a job with a lot of output costs the coordinator's memory, and whether it
comes back (issue 35: eight portal views of one job with 48 MiB of output took the
coordinator from 175 MiB to 1.24 GiB, never given back).

    .venv/bin/python benchmarks/portal_memory.py [--mib 48] [--views 8] [--json FILE]

A real ``vpool-coordinator serve`` process (HTTPS on 127.0.0.1, port 0) over a state made
here: a finished job with ``--mib`` MiB of output in 16 KiB chunks over 4 ranks, and a
baseline job with none. Each view is what a user's browser and ``vsdk`` do: the portal's job
page, its live feed read to its ``end`` event (every byte of output), and the API's output
pages read to the last. The coordinator's resident memory (``VmRSS``) is read before and after
``--views`` views of each job (and again once the coordinator had time to trim its heap,
``vpool.heap``), and its peak (``VmHWM``, reset before each set) during them. Printed: the
peak and what stays after the big job's views, against the baseline job's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec
import trio

from vpool import heap, tls
from vpool.coordinator import keys, pooldir
from vpool.coordinator.service import Coordinator
from vpool.coordinator.settings import CoordinatorSettings
from vpool.protocol import api

CHUNK = 16 * 1024
SETTLE = heap.PERIOD + 2.0
DEADLINE = 60.0


def _state(tmp: Path, mib: int) -> tuple[str, str, int, int]:
    """The coordinator's state: alice, her token and a portal session of hers, a job
    without output and one with."""
    core = Coordinator(CoordinatorSettings(state_dir=str(tmp / "state")))
    store, now = core.store, core.clock()
    token, token_hash = keys.new_api_token()
    store.add_user("alice", token_hash, now)
    db = store.db  # type: ignore[attr-defined]
    store.add_blob("0" * 64, 0, now, "alice")  # the bundle, as uploaded (never read here)
    jobs = []
    for size in (0, mib << 20):
        sub = api.JobSubmit(ranks=4, bundle="0" * 64, entry="app.py", name=f"{size} bytes")
        job = store.create_job("alice", sub, now - 600)
        line = b"step 000000 of rank 0: residual 1.234567e-03 and some more text to read\n"
        chunk = (line * (CHUNK // len(line) + 1))[:CHUNK]
        with db.atomic():
            db.execute(
                "UPDATE jobs SET state = 'succeeded', started = ?, finished = ?, exit_code = 0, "
                "output_bytes = ? WHERE id = ?",
                [now - 590, now - 10, size, job.id],
            )
            db.execute(
                "UPDATE ranks SET state = 'exited', exit_code = 0, incarnation = 1 WHERE job = ?",
                [job.id],
            )
            db.conn.executemany(
                "INSERT INTO output (job, rank, stream, offset, data) VALUES (?, ?, ?, ?, ?)",
                ([job.id, n % 4, "stdout", (n // 4) * CHUNK, chunk] for n in range(size // CHUNK)),
            )
        jobs.append(job.id)
    cookie, _, _ = trio.run(core.sign_in, token)
    core.close()
    return token, cookie, jobs[0], jobs[1]


def _pool(tmp: Path) -> pooldir.PoolDir:
    """The pool's files as ``vpool-coordinator init --public-url https://127.0.0.1`` makes
    them (CA, certificate, settings), its state in ``tmp/state``."""
    pool = pooldir.PoolDir(tmp / "pool")
    pooldir.make_pool(
        pool,
        public_url="https://127.0.0.1",
        host="127.0.0.1",
        pool_name="bench",
        state_dir=tmp / "state",
        now=dt.datetime.now(dt.UTC),
    )
    return pool


def _memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of ``pid`` in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS


def _view(client: httpx.Client, token: str, job: int) -> int:
    """One view of ``job``: its page, its live feed to the end, its output pages by API.
    The bytes of output read (twice: feed and API)."""
    page = client.get(f"/jobs/{job}")
    assert page.status_code == 200, page.text[:300]
    got = 0
    ended = False
    with client.stream("GET", f"/jobs/{job}/live") as feed:
        assert feed.status_code == 200
        for line in feed.iter_lines():
            if line.startswith("data: ["):
                records = msgspec.json.decode(line[6:], type=list[api.OutputRecord])
                got += sum(len(r.data) for r in records)
            elif line == "event: end":
                ended = True
                break
    assert ended, "the live feed did not end"
    after = 0
    while True:
        r = client.get(
            f"/api/v1/jobs/{job}/output",
            params={"after": after},
            headers={"Authorization": f"Bearer {token}"},
        )
        assert r.status_code == 200, r.text[:300]
        page = msgspec.json.decode(r.content, type=api.OutputPage)
        got += sum(len(rec.data) for rec in page.records)
        after = page.next
        if page.complete:
            return got


def _views(pid: int, client: httpx.Client, token: str, job: int, views: int) -> dict[str, int]:
    """Memory before, at the peak of, right after and ``SETTLE`` s after ``views`` views."""
    before = _memory(pid)["VmRSS"]
    _reset_peak(pid)
    read = sum(_view(client, token, job) for _ in range(views))
    mem = _memory(pid)
    time.sleep(SETTLE)  # the coordinator trims its heap at most once a heap.PERIOD
    settled = _memory(pid)["VmRSS"]
    return {
        "before": before,
        "peak": mem["VmHWM"],
        "after": mem["VmRSS"],
        "settled": settled,
        "read": read,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=48)
    parser.add_argument("--views", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        pool = _pool(tmp)
        token, cookie, small, big = _state(tmp, args.mib)
        env = {k: v for k, v in os.environ.items() if not k.startswith("VPOOL_")}
        env["VPOOL_HOME"] = str(tmp / "home")
        # Port 0, and the URL the ready file gives (not the public URL's port 443).
        env["VPOOL_COORDINATOR_PORT"] = "0"
        env["VPOOL_COORDINATOR_PUBLIC_URL"] = ""
        ready = tmp / "ready.json"
        serve = Path(sys.executable).with_name("vpool-coordinator")
        proc = subprocess.Popen(
            [str(serve), "serve", "--config", str(pool.settings), "--ready-file", str(ready)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            end = time.monotonic() + DEADLINE
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > end:
                    sys.exit("the coordinator did not start")
                time.sleep(0.05)
            url = json.loads(ready.read_text())["url"]
            verify = tls.client_context(pool.ca_cert)
            with httpx.Client(base_url=url, verify=verify, timeout=60) as client:
                client.cookies.set("vpool_session", cookie)
                _view(client, token, small)  # warm: imports, templates, caches
                base = _views(proc.pid, client, token, small, args.views)
                heavy = _views(proc.pid, client, token, big, args.views)
                again = _views(proc.pid, client, token, small, args.views)
        finally:
            proc.terminate()
            proc.wait(timeout=DEADLINE)
    assert heavy["read"] == 2 * args.views * (args.mib << 20), heavy["read"]
    mib = 1 << 20
    figures = {
        "views": args.views,
        "output_mib": args.mib,
        "baseline_peak_mib": base["peak"] / mib,
        "big_peak_mib": heavy["peak"] / mib,
        "peak_ratio": heavy["peak"] / base["peak"],
        "rss_before_mib": heavy["before"] / mib,
        "rss_right_after_mib": heavy["after"] / mib,
        "rss_settled_mib": heavy["settled"] / mib,
        "settled_ratio": heavy["settled"] / heavy["before"],
        "rss_settled_baseline_again_mib": again["settled"] / mib,
    }
    print(
        f"{args.views} views of a job with {args.mib} MiB of output (page, live feed to its "
        f"end, API pages; {heavy['read'] / mib:.0f} MiB read):"
    )
    print(
        f"  coordinator peak   {figures['big_peak_mib']:7.1f} MiB  vs  "
        f"{figures['baseline_peak_mib']:7.1f} MiB viewing a job without output  "
        f"(x{figures['peak_ratio']:.2f})"
    )
    print(
        f"  resident {SETTLE:g} s after  {figures['rss_settled_mib']:7.1f} MiB  vs  "
        f"{figures['rss_before_mib']:7.1f} MiB before the views  "
        f"(x{figures['settled_ratio']:.2f}; {figures['rss_right_after_mib']:.1f} MiB right "
        f"after them); {figures['rss_settled_baseline_again_mib']:.1f} MiB after the "
        "baseline's views again"
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
