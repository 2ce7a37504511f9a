"""Where the CPU of one checkpoint goes, for the issue-5 stencil rank, part by part.

    .venv/bin/python benchmarks/checkpoint_costs.py [--mb 200] [--repeat 3] [--json FILE]

``benchmarks/checkpoint_overhead.py`` measures the whole (a 4-rank stencil with checkpoints on
and off); this takes one checkpoint of one rank of that stencil apart, to show which part costs
what and how low the whole can go on this machine. The baseline, measured in the same run, is
the CPU of one step of the stencil on a rank of ``--mb`` megabytes (examples/stencil.py's grid);
every part is printed in CPU seconds and in those steps:

- ``criu``: ``criu dump`` (the agent's ``criu.dump``) of a process holding the stencil's two
  arrays: CRIU's CPU and wall time. Needs root and CRIU; without them a synthetic image of the
  same size stands in for the next two parts, and this one is reported missing.
- ``criu_pipe``: the same with the pages written into a ``criu.PagesPipe``, as the agent does
  (``checkpoint_stream_pages``); this one, not ``criu``, counts in the sum.
- ``pack``: ``ImageWriter.pack`` over those images (tar, sampled zstd, AES-GCM, BLAKE3).
- ``upload``: the same packed and sent with the agent's store client (``open_store``) to a real
  ``vpool-relay`` on 127.0.0.1: the agent thread's CPU (pack and TLS) and the relay's. Through
  the relay's same-host socket, as an agent on the relay's machine does (``protocol.local``);
  the same over loopback TCP (with the transport MAC) is printed beside it, not summed.
- ``primitives`` (printed first, not summed): the CPU of each per-byte operation of a
  checkpoint over ``--mb`` of random bytes in 1 MiB pieces, AES-256-GCM (the sealing) being
  the baseline they are also given as ratios against: Poly1305 (the transport MAC, both
  ends), the skeleton digest (``protocol.ckptdigest``, both ends), and BLAKE3 and SHA-256 of
  every byte (the digests images had before).
- ``cow``: what the running rank pays because a forked clone shares its memory while CRIU dumps
  it: the stencil's CPU over the steps of one dump's wall time, with a clone alive for that
  time, minus the same steps without (copy-on-write faults).

The projection: the issue's run (4 ranks on ``--cores`` cores, a checkpoint every 30 s,
``--run-s`` seconds without checkpoints) adds ``ranks * run/30`` checkpoints of that CPU, so
with every core busy it can be no faster than ``1 + that CPU / (cores * run)``: the floor the
measured overhead sits on (the rest is memory bandwidth and the ranks waiting for each other).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import blake3
import numpy as np
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.poly1305 import Poly1305

from vpool.protocol.api import RelayInfo
from vpool.protocol.ckptdigest import ImageDigest
from vpool.protocol.messages import CkptPut
from vpool.protocol.tokens import AgentClaims, RankClaims, sign_token
from vpool.tls import client_context
from vpool.worker_agent import ckpt_image, criu
from vpool.worker_agent.settings import AgentSettings
from vpool.worker_agent.store_client import open_store

sys.path.insert(0, str(Path(__file__).resolve().parent))
from relay_alone import running_relay, tree_cpu

COLS = 4096  # examples/stencil.py's row length
# A process holding the stencil's arrays (the same grid and values as a rank of
# examples/stencil.py), stepping until it is dumped; it says when it is ready in a file.
HOLDER = """
import sys, numpy as np
rows, ready = int(sys.argv[1]), sys.argv[2]
u = np.random.default_rng(1).random((rows + 2, 4096)); v = u.copy()
open(ready, "w").close()
while True:
    u[1:-1, 1:-1] = 0.25 * (v[:-2, 1:-1] + v[2:, 1:-1] + v[1:-1, :-2] + v[1:-1, 2:])
    u, v = v, u
"""


def rows_for(mb: float) -> int:
    return max(1, int(mb * 2**20 / 2 / 8 / COLS) - 2)


def cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class Stencil:
    """One rank's two arrays and its step, in this process."""

    def __init__(self, mb: float) -> None:
        self.u = np.random.default_rng(1).random((rows_for(mb) + 2, COLS))
        self.v = self.u.copy()

    def step(self) -> None:
        u, v = self.u, self.v
        u[1:-1, 1:-1] = 0.25 * (v[:-2, 1:-1] + v[2:, 1:-1] + v[1:-1, :-2] + v[1:-1, 2:])
        self.u, self.v = v, u

    def steps_cpu(self, n: int) -> float:
        t = cpu_self()
        for _ in range(n):
            self.step()
        return cpu_self() - t


def step_cpu(stencil: Stencil, repeat: int) -> float:
    stencil.steps_cpu(3)  # every page touched once
    return statistics.median(stencil.steps_cpu(5) / 5 for _ in range(repeat))


def cow_cpu(stencil: Stencil, steps: int, hold: float, repeat: int) -> tuple[float, float]:
    """(CPU of ``steps`` steps with a clone alive for ``hold`` s, the same without), medians."""
    plain, forked = [], []
    for _ in range(repeat):
        plain.append(stencil.steps_cpu(steps))
        pid = os.fork()
        if pid == 0:  # the clone: holds the memory as it stood, like one CRIU is dumping
            time.sleep(hold)
            os._exit(0)
        forked.append(stencil.steps_cpu(steps))
        os.waitpid(pid, 0)
    return statistics.median(forked), statistics.median(plain)


def dump_holder(
    mb: float, images: Path, criu_bin: str, *, streamed: bool = False
) -> tuple[float, float]:
    """``criu dump`` a process holding a stencil rank's arrays into ``images``: (CPU, wall).
    ``streamed``: the pages into a ``criu.PagesPipe`` (as the agent does) that a thread reads
    and drops, its reads not counted (the pack reads the pages file instead)."""
    ready = images.parent / "ready"
    ready.unlink(missing_ok=True)
    holder = subprocess.Popen(
        ["setsid", sys.executable, "-c", HOLDER, str(rows_for(mb)), str(ready)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if time.monotonic() > deadline or holder.poll() is not None:
                raise RuntimeError("the stencil process did not start")
            time.sleep(0.02)
        before = cpu_children()
        if not streamed:
            wall = trio.run(lambda: criu.dump(holder.pid, images, criu=criu_bin, timeout=300))
            return cpu_children() - before, wall
        images.mkdir(parents=True)
        pipe = criu.PagesPipe(images)
        buf = memoryview(bytearray(1 << 20))

        def drain() -> None:
            while pipe.read_into(buf):
                pass

        reader = threading.Thread(target=drain)
        reader.start()
        try:
            wall = trio.run(lambda: criu.dump(holder.pid, images, criu=criu_bin, timeout=300))
        finally:
            pipe.ended(None)
            reader.join()
            pipe.close()
        return cpu_children() - before, wall
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.wait()


def synthetic_images(mb: float, images: Path) -> None:
    """A stand-in for CRIU's images: the arrays as one pages file, a few small files."""
    images.mkdir(parents=True, exist_ok=True)
    stencil = Stencil(mb)
    with open(images / "pages-1.img", "wb") as f:
        f.write(stencil.u.tobytes())
        f.write(stencil.v.tobytes())
    for name in ("core-1.img", "mm-1.img", "pagemap-1.img"):
        (images / name).write_bytes(os.urandom(4096))


def primitives(mb: float) -> dict[str, float]:
    """CPU seconds of each per-byte operation over ``mb`` MiB (module docstring)."""
    pieces = [os.urandom(1 << 20) for _ in range(8)]
    n = max(1, round(mb))
    aead = AESGCM(os.urandom(32))
    nonce = os.urandom(12)
    frame = ckpt_image.ImageWriter(os.urandom(32), job=1, rank=0, ckpt=1)
    sealed = [bytes(f) for f in frame.seal(pieces)]  # real frames, for the skeleton digest
    mac = Poly1305(os.urandom(32))
    blake = blake3.blake3()
    sha = hashlib.sha256()
    digest = ImageDigest()
    digest.update(sealed[0])
    ops: dict[str, Callable[[int], object]] = {
        "aes-256-gcm": lambda i: aead.encrypt(nonce, pieces[i % 8], b"aad"),
        "poly1305": lambda i: mac.update(pieces[i % 8]),
        "skeleton digest": lambda i: digest.update(sealed[1 + i % 8]),
        "blake3": lambda i: blake.update(pieces[i % 8]),
        "sha-256": lambda i: sha.update(pieces[i % 8]),
    }
    out = {}
    for name, op in ops.items():
        t = time.thread_time()
        for i in range(n):
            op(i)
        out[name] = time.thread_time() - t
    return out


def pack_cpu(images: Path, rank_dir: Path) -> tuple[float, int]:
    writer = ckpt_image.ImageWriter(os.urandom(32), job=1, rank=0, ckpt=1, reuse=True)
    t = cpu_self()
    for _ in writer.pack(images, rank_dir):
        pass
    return cpu_self() - t, writer.size


def upload_cpu(
    images: Path, rank_dir: Path, repeat: int, *, local: bool = True
) -> tuple[float, float]:
    """Pack and upload the image ``repeat`` times to a real relay on 127.0.0.1, through its
    same-host socket (``local``, as an agent does) or loopback TCP: medians of (this thread's
    CPU, the relay's CPU) per upload."""
    key = Ed25519PrivateKey.generate()
    expires = time.time() + 3600
    agent_token = sign_token(AgentClaims(agent="bench", expires=expires), key)
    rank_token = sign_token(
        RankClaims(job=1, rank=0, incarnation=1, size=4, agent="bench", expires=expires), key
    )
    mine, theirs = [], []
    with running_relay(key) as (relay, port, ca):
        info = RelayInfo(name="bench", host="127.0.0.1", port=port)
        ssl_context = client_context(ca)
        max_payload = AgentSettings().max_payload
        for ckpt in range(1, repeat + 1):
            writer = ckpt_image.ImageWriter(os.urandom(32), job=1, rank=0, ckpt=ckpt, reuse=True)
            put = CkptPut(
                token=rank_token, ckpt=ckpt, received={}, dets=0, fingerprint="bench", meta=b"{}"
            )
            relay_before, t = tree_cpu(relay.pid), time.thread_time()
            with open_store(
                info,
                ssl_context=ssl_context,
                token=agent_token,
                max_payload=max_payload,
                local=local,
            ) as conn:
                assert conn.local is local
                conn.put_begin(put)
                for piece in writer.pack(images, rank_dir):
                    conn.put_chunk(ckpt, piece)
                conn.put_end(ckpt, writer.size, writer.digest, timeout=300)
            mine.append(time.thread_time() - t)
            theirs.append(tree_cpu(relay.pid) - relay_before)
    return statistics.median(mine), statistics.median(theirs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0, help="a rank's arrays (MiB)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--run-s", type=float, default=125.0, help="the run without checkpoints")
    parser.add_argument("--every", type=float, default=30.0)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    out: dict[str, object] = {"mb": args.mb}
    say = functools.partial(print, flush=True)

    stencil = Stencil(args.mb)
    step = step_cpu(stencil, args.repeat)
    out["step_cpu_s"] = step
    say(f"baseline: one stencil step of a {args.mb:g} MiB rank: {step * 1000:.1f} ms CPU")

    prims = primitives(args.mb)
    out["primitives_cpu_s"] = prims
    base = prims["aes-256-gcm"]
    say(f"primitives over {args.mb:g} MiB (CPU s, and against AES-256-GCM):")
    for name, cpu in prims.items():
        say(f"  {name:<16} {cpu:6.3f}   {cpu / base:5.2f}x")

    criu_bin = shutil.which("criu") or ""
    parts: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        images, rank_dir = Path(d, "images"), Path(d, "rank")
        rank_dir.mkdir()
        hold = 0.3  # what a dump of ~240 MB takes here when CRIU cannot say
        if criu_bin and os.geteuid() == 0:
            dumps = []
            for _ in range(args.repeat):  # the images of the last one are packed below
                shutil.rmtree(images, ignore_errors=True)
                dumps.append(dump_holder(args.mb, images, criu_bin))
            cpu = statistics.median(c for c, _ in dumps)
            hold = statistics.median(w for _, w in dumps)
            parts["criu"] = cpu
            out["criu_dumps"] = dumps
            size = sum(f.stat().st_size for f in images.iterdir())
            say(f"criu dump: {cpu:.3f} s CPU, {hold:.3f} s wall, {size / 1e6:.1f} MB of images")
            piped = []
            for i in range(args.repeat):
                d_images = Path(d, f"piped-{i}")
                piped.append(dump_holder(args.mb, d_images, criu_bin, streamed=True))
                shutil.rmtree(d_images)
            parts["criu_pipe"] = statistics.median(c for c, _ in piped)
            out["criu_pipe_dumps"] = piped
            say(
                f"criu dump, pages into a pipe: {parts['criu_pipe']:.3f} s CPU, "
                f"{statistics.median(w for _, w in piped):.3f} s wall"
            )
        else:
            synthetic_images(args.mb, images)
            say("criu dump: not measured (needs root and criu); a synthetic image stands in")
        packs = [pack_cpu(images, rank_dir) for _ in range(args.repeat)]
        parts["pack"] = statistics.median(cpu for cpu, _ in packs)
        say(f"pack: {parts['pack']:.3f} s CPU for {packs[0][1] / 1e6:.1f} MB")
        agent, relay = upload_cpu(images, rank_dir, args.repeat)
        parts["upload_agent"], parts["upload_relay"] = agent, relay
        say(f"upload: agent {agent:.3f} s CPU (pack included), relay {relay:.3f} s CPU")
        tcp = upload_cpu(images, rank_dir, args.repeat, local=False)
        out["upload_tcp_cpu_s"] = tcp
        say(
            f"upload over loopback TCP (not counted): agent {tcp[0]:.3f} s CPU, relay "
            f"{tcp[1]:.3f} s CPU; the same-host socket takes {(agent + relay) / sum(tcp):.2f}x"
        )

    steps = max(1, round(hold / step))
    forked, plain = cow_cpu(stencil, steps, hold, args.repeat)
    parts["cow"] = max(0.0, forked - plain)
    say(
        f"copy-on-write: {steps} steps with a clone alive {hold:.2f} s: {forked:.3f} s CPU, "
        f"without {plain:.3f} s ({forked / plain:.2f}x)"
    )
    # The agent streams the pages (checkpoint_stream_pages): CRIU's cost is the pipe's.
    dump_cpu = parts.get("criu_pipe", parts.get("criu", 0.0))
    per_ckpt = dump_cpu + parts["upload_agent"] + parts["upload_relay"] + parts["cow"]
    out["parts_cpu_s"] = parts
    out["per_checkpoint_cpu_s"] = per_ckpt
    checkpoints = args.ranks * int(args.run_s // args.every)
    floor = 1 + checkpoints * per_ckpt / (args.cores * args.run_s)
    out["projected_floor"] = floor
    say("")
    say("part            CPU s   in steps")
    notes = {
        "criu": " (pages into a file: not counted below)" if "criu_pipe" in parts else "",
        "pack": " (part of upload_agent)",
    }
    for name in ("criu", "criu_pipe", "pack", "upload_agent", "upload_relay", "cow"):
        if name in parts:
            note = notes.get(name, "")
            say(f"{name:<14} {parts[name]:6.3f}   {parts[name] / step:7.1f}{note}")
    say(f"{'one checkpoint':<14} {per_ckpt:6.3f}   {per_ckpt / step:7.1f}")
    say(
        f"projection: {checkpoints} checkpoints in a {args.run_s:g} s run on {args.cores} "
        f"cores: at least {floor:.3f}x the run without (issue 5 asks at most 1.05x)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
