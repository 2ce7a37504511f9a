"""Checkpoints with the real CRIU on a real local pool: images made, ranks restored from them.

Each test starts its own pool (`vsdk local up`), runs tests/integration/programs/ckpt_stencil.py
(rank 0 prints a line every 10 steps and a checksum: deterministic output) with checkpoints
while SIGKILLing rank processes (or an agent) by pid, and checks that the job's events say how
each rank came back (`rank_restored` from an image, `restore_failed` with the reason,
`rank_replaying` from the beginning) and that the output is byte-identical to a fault-free run's
under real `mpiexec`. Waits are for events, with deadlines; no sleeping for time to pass.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.integration.conftest import children, end_process, environ_of, reference_soon, stdout_of

if TYPE_CHECKING:
    from collections.abc import Callable

    from conftest import Pool

REPO = Path(__file__).resolve().parents[2]
PROGRAM = str(REPO / "tests" / "integration" / "programs" / "ckpt_stencil.py")

pytestmark = pytest.mark.slow


@pytest.fixture
def pool(fresh_pool: Pool) -> Pool:
    """A pool of each test's own (3 agents, 2 relays): the tests kill and reconfigure parts."""
    return fresh_pool


# -- helpers ---------------------------------------------------------------------------------


def submit(
    pool: Pool, ranks: int, *args: str, every: float = 0.0, stdin: Path | None = None
) -> int:
    flags = ["--checkpoint-every", f"{every:g}"] if every > 0 else []
    flags += ["--stdin", str(stdin)] if stdin is not None else []
    res = pool.vsdk("submit", PROGRAM, "--ranks", str(ranks), *flags, "--json", "--", *args)
    assert res.returncode == 0, res.stderr.decode()
    return int(json.loads(res.stdout)["id"])


def detail(pool: Pool, job: int) -> dict | None:
    return pool.status(job)


def wait_until(
    pool: Pool, job: int, cond: Callable[[dict], bool], what: str, timeout: float = 60
) -> dict:
    return pool.wait(job, cond, what, timeout)


def ended(d: dict) -> bool:
    return d["job"]["state"] in ("succeeded", "failed", "cancelled")


def all_running(d: dict) -> bool:
    return d["job"]["state"] == "running" and all(r["state"] == "running" for r in d["ranks"])


def events(d: dict, kind: str, rank: int | None = None) -> list[dict]:
    return [e for e in d["events"] if e["kind"] == kind and (rank is None or e["rank"] == rank)]


def checkpoints_of(rank: int, n: int) -> Callable[[dict], bool]:
    """The job ended (the caller's assertions then say why that is too early), or ``rank`` has
    at least ``n`` images committed."""
    return lambda d: ended(d) or len(events(d, "checkpoint", rank)) >= n


def ckpt_id(message: str) -> int:
    """The checkpoint id in an event message ("... checkpoint 1763712345678 ...")."""
    return int(message.split("checkpoint ", 1)[1].split()[0].strip("():,"))


def output(pool: Pool, job: int) -> bytes:
    res = pool.vsdk("logs", str(job))
    assert res.returncode == 0, res.stderr.decode()
    return res.stdout


def reference(ranks: int, *args: str, stdin: Path | None = None) -> Future[bytes]:
    """The output of a fault-free run (real ``mpiexec``'s, once per test session), made while
    the test runs its job: the program mostly sleeps, under ``mpiexec`` as in the pool."""
    return reference_soon(PROGRAM, ranks, *args, stdin=stdin)


def finish(pool: Pool, job: int, ref: Future[bytes] | bytes) -> dict:
    """The job's end: it succeeded, and printed ``ref`` (or what the future ``ref`` gives)."""
    d = wait_until(pool, job, ended, "job end", timeout=120)
    assert d["job"]["state"] == "succeeded", (d, pool.logs())
    assert output(pool, job) == (ref if isinstance(ref, bytes) else ref.result())
    return d


def rank_pid(pool: Pool, rank: int, job: int, agent_prefix: str = "agent") -> int:
    return pool.rank_pid(rank, job, agent_prefix)


def job_dirs(pool: Pool, job: int) -> list[Path]:
    """The job's directory on each relay: data_dir/jobs/<job> (relay-i/data in a local pool)."""
    return sorted((pool.home / "state" / "local-pool").glob(f"relay-*/data/jobs/{job}"))


def images(pool: Pool, job: int, rank: int) -> list[Path]:
    """The committed images of ``rank``, oldest first (checkpoint ids increase)."""
    found = [p for d in job_dirs(pool, job) for p in (d / str(rank) / "ckpt").glob("*.img")]
    return sorted(found, key=lambda p: int(p.stem))


def sizes(pool: Pool, job: int) -> tuple[int, int]:
    """Bytes of the job's message log segments and of its images, on every relay."""
    segs = imgs = 0
    for d in job_dirs(pool, job):
        for f in d.rglob("*"):
            try:
                n = f.stat().st_size
            except FileNotFoundError:
                continue  # trimmed meanwhile
            if f.suffix == ".seg":
                segs += n
            elif f.suffix == ".img":
                imgs += n
    return segs, imgs


def checkpoint_now(pool: Pool, job: int, rank: int) -> None:
    res = pool.vsdk("checkpoint", str(job), "--rank", str(rank))
    assert res.returncode == 0, res.stderr.decode()


def live_agents(pool: Pool) -> int:
    res = pool.vsdk("info", "--json")
    assert res.returncode == 0, res.stderr.decode()
    return int(json.loads(res.stdout)["pool"]["agents"])


def wait_agents(pool: Pool, n: int, timeout: float = 40) -> None:
    deadline = time.monotonic() + timeout
    while live_agents(pool) != n:
        assert time.monotonic() < deadline, f"not {n} live agents after {timeout} s"
        time.sleep(0.2)


def agent_id(pool: Pool, name: str) -> str:
    info = json.loads(
        (pool.home / "state" / "local-pool" / "run" / f"{name}.ready.json").read_text()
    )
    return str(info["agent_id"])


def wait_clone(pool: Pool, job: int, rank: int, timeout: float = 30) -> int:
    """The checkpoint clone of the rank process ``rank`` (pid): its child with the same rank
    environment whose stdout is /dev/null (what the clone points it at)."""
    want = environ_of(rank).get(b"VPOOL_RANK")
    deadline = time.monotonic() + timeout
    while True:
        for child in children(rank):
            if environ_of(child).get(b"VPOOL_RANK") == want and stdout_of(child) == "/dev/null":
                return child
        if time.monotonic() > deadline:
            d = detail(pool, job)
            raise AssertionError(
                f"no checkpoint clone of {rank} after {timeout} s: {d}\n{pool.logs()}"
            )
        time.sleep(0.002)


# -- tests -------------------------------------------------------------------------------------


def test_killed_rank_is_restored_from_its_checkpoint(pool: Pool, tmp_path: Path) -> None:
    # Rank 0 reads a line of stdin per step, 100 bytes each: Python reads ahead 8 KiB at a
    # time, so each restored rank 0 must find its stdin file where its image left it.
    stdin = tmp_path / "stdin.txt"
    stdin.write_text("".join(f"line {i:04d} {'x' * 89}\n" for i in range(1, 601)))
    ref = reference(4, "600", stdin=stdin)
    job = submit(pool, 4, "600", every=2, stdin=stdin)
    d = wait_until(pool, job, checkpoints_of(0, 2), "2 checkpoints of rank 0")
    assert not ended(d), f"the job ended before 2 checkpoints of rank 0: {d['events']}"
    os.kill(rank_pid(pool, 0, job), signal.SIGKILL)  # rank 0 prints: its output must go on
    d = wait_until(
        pool, job, lambda d: ended(d) or events(d, "rank_restored", 0), "rank 0 restored"
    )
    assert not ended(d), d["events"]
    # The restored incarnation (in a PID namespace of its own) takes checkpoints too, and is
    # restored from one of them when killed again.
    made = len(events(d, "checkpoint", 0))
    d = wait_until(pool, job, checkpoints_of(0, made + 1), "a checkpoint of the restored rank")
    assert not ended(d), f"the job ended before the restored rank's checkpoint: {d['events']}"
    newest = ckpt_id(events(d, "checkpoint", 0)[-1]["message"])
    os.kill(rank_pid(pool, 0, job), signal.SIGKILL)
    d = finish(pool, job, ref)
    # (Every step's line, each with its line of stdin: the comparison covers them all.)
    assert b"step 600: " in ref.result() and b" line 0600 x" in ref.result(), ref.result()[-300:]
    assert len(events(d, "rank_lost", 0)) == 2, d["events"]
    restored = events(d, "rank_restored", 0)
    assert len(restored) == 2, d["events"]
    # From an image the restored incarnation made (a newer one may have come before the kill).
    assert ckpt_id(restored[1]["message"]) >= newest > ckpt_id(restored[0]["message"]), restored
    assert not events(d, "rank_replaying", 0), d["events"]
    # Every checkpoint of rank 0, restored or not, was made. Another rank's may fail only for
    # the reason it must: blocked in a Sendrecv with rank 0 while rank 0 was dead or being
    # restored, it reached no safe point in time (on a busy machine a restore can take that
    # long); the next one is taken as usual.
    assert not events(d, "checkpoint_failed", 0), d["events"]
    for failed in events(d, "checkpoint_failed"):
        assert "reached no safe point" in failed["message"], d["events"]
    assert all(e["rank"] is not None for e in events(d, "checkpoint")), d["events"]


def test_checkpoint_command_then_kill_restores_from_it(pool: Pool) -> None:
    ref = reference(4, "600")
    job = submit(pool, 4, "600")  # no periodic checkpoints: only the one asked for
    wait_until(pool, job, lambda d: ended(d) or b"step 30:" in output(pool, job), "progress")
    checkpoint_now(pool, job, 1)
    d = wait_until(pool, job, checkpoints_of(1, 1), "the checkpoint of rank 1")
    assert not ended(d), f"the job ended before the checkpoint: {d['events']}"
    assert not events(d, "checkpoint", 0), "only rank 1 was asked for a checkpoint"
    (image,) = images(pool, job, 1)
    os.kill(rank_pid(pool, 1, job), signal.SIGKILL)
    d = finish(pool, job, ref)
    restored = events(d, "rank_restored", 1)
    assert restored, d["events"]
    assert image.stem in restored[0]["message"], restored
    assert not events(d, "rank_replaying", 1), d["events"]


def test_relay_logs_stay_bounded_with_periodic_checkpoints(pool: Pool) -> None:
    # Small log segments, so trimming (whole segments) shows within a short run.
    for relay in [p["name"] for p in pool.pids() if p["name"].startswith("relay-")]:
        os.kill(pool.pid_of(relay), signal.SIGKILL)
        config = pool.home / "state" / "local-pool" / relay / "config.toml"
        config.write_text(config.read_text() + "segment_size = 1048576\n")
        res = pool.vsdk("local", "restart", relay)
        assert res.returncode == 0, res.stderr.decode()
    steps, cols, ranks = 700, 8192, 4  # 64 KiB halos: 384 KiB into the logs per step
    job = submit(pool, ranks, str(steps), str(cols), "0.02", every=2)
    # Untrimmed, rank r's log would hold every halo it received: 2 per step in the middle.
    per_step = sum(2 if 0 < r < ranks - 1 else 1 for r in range(ranks)) * cols * 8
    d = wait_until(pool, job, lambda d: ended(d) or all_running(d), "all ranks running")
    first = wait_until(
        pool,
        job,
        lambda d: ended(d) or all(len(events(d, "checkpoint", r)) >= 3 for r in range(ranks)),
        "3 checkpoints of every rank",
    )
    assert not ended(first), f"the job ended before 3 checkpoints per rank: {first['events']}"
    window = sizes(pool, job)[0]  # the log once trimming has started
    bound = 2 * window + ranks * 2 * 1048576  # + a partly filled segment per rank and channel
    samples: list[tuple[int, int, int]] = []  # (step, segment bytes, image bytes)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        d = detail(pool, job)
        if d is not None and ended(d):
            break
        lines = [ln for ln in output(pool, job).split(b"\n") if ln.startswith(b"step ")]
        step = int(lines[-1].split()[1].rstrip(b":")) if lines else 0
        segs, imgs = sizes(pool, job)
        samples.append((step, segs, imgs))
        for r in range(ranks):
            assert len(images(pool, job, r)) <= 3, f"rank {r} keeps {images(pool, job, r)}"
        time.sleep(0.5)
    d = wait_until(pool, job, ended, "job end", timeout=60)
    assert d["job"]["state"] == "succeeded", (d, pool.logs())
    late = [s for s in samples if s[0] >= steps // 2]
    assert late, f"no sample in the second half of the run: {samples}"
    worst = max(segs for _, segs, _ in samples)
    assert worst <= bound, f"logs grew to {worst} B (bound {bound} B): {samples}"
    step, segs, _ = late[-1]
    assert segs < 0.5 * step * per_step, f"logs not trimmed: {segs} B at step {step}: {samples}"
    print(f"log bytes: window {window}, max {worst}, untrimmed at the end {step * per_step}")


def test_corrupted_image_is_detected_and_the_previous_one_used(pool: Pool) -> None:
    ref = reference(4, "600")
    # Periodic checkpoints, 3 s apart: the newest image is corrupted and the rank killed within
    # a fraction of that, before another image could be committed.
    job = submit(pool, 4, "600", every=3)
    d = wait_until(pool, job, checkpoints_of(1, 2), "two checkpoints of rank 1")
    assert not ended(d), f"the job ended before 2 checkpoints: {d['events']}"
    older, newest = images(pool, job, 1)[-2:]
    with open(newest, "r+b") as f:  # flip one byte in the middle of the stored image
        f.seek(newest.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.kill(rank_pid(pool, 1, job), signal.SIGKILL)
    d = finish(pool, job, ref)
    failed = events(d, "restore_failed", 1)
    assert failed, d["events"]
    assert newest.stem in failed[0]["message"], failed
    reason = failed[0]["message"].lower()
    assert any(w in reason for w in ("sha", "hash", "corrupt", "tag", "integrity")), failed
    restored = events(d, "rank_restored", 1)
    if restored:  # from the previous image ...
        assert older.stem in restored[0]["message"], restored
    else:  # ... or, if that one could not be used either, from the beginning
        assert events(d, "rank_replaying", 1), d["events"]


def test_image_is_never_restored_on_a_mismatched_fingerprint(pool: Pool) -> None:
    """The agents other than agent-0 get another `fingerprint_salt` (in their config files:
    `vsdk local` starts agents from config files and keeps VPOOL_AGENT_* variables from them),
    so their fingerprint differs from agent-0's. The job runs on agent-0 alone; agent-0 is then
    killed with its ranks: only mismatched agents are left, and no image may be restored there."""
    ref = reference(2, "300")
    others = [p["name"] for p in pool.pids() if p["name"].startswith("agent-")]
    others.remove("agent-0")
    for name in others:
        os.kill(pool.pid_of(name), signal.SIGKILL)
        config = pool.home / "state" / "local-pool" / name / "config.toml"
        config.write_text(config.read_text() + 'fingerprint_salt = "another machine"\n')
    wait_agents(pool, 1)  # the coordinator places nothing on the others now
    job = submit(pool, 2, "300", every=2)
    wait_until(pool, job, lambda d: ended(d) or all_running(d), "all ranks running")
    for name in others:
        res = pool.vsdk("local", "restart", name)
        assert res.returncode == 0, res.stderr.decode()
    d = wait_until(
        pool,
        job,
        lambda d: ended(d) or all(len(events(d, "checkpoint", r)) >= 2 for r in range(2)),
        "2 checkpoints of each rank",
    )
    assert not ended(d), f"the job ended before the checkpoints: {d['events']}"
    home = agent_id(pool, "agent-0")
    assert all(r["agent"] == home for r in d["ranks"]), d["ranks"]
    victims = [rank_pid(pool, r, job) for r in range(2)]
    os.kill(pool.pid_of("agent-0"), signal.SIGKILL)
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # gone with its agent
    # Only mismatched agents are up: the ranks wait for a matching agent, or replay from the
    # beginning there; never restored.
    d = wait_until(
        pool,
        job,
        lambda d: (
            ended(d)
            or all(
                events(d, "rank_waiting_restore", r) or events(d, "rank_replaying", r)
                for r in range(2)
            )
        ),
        "the lost ranks waiting for a matching agent (or replaying)",
    )
    assert not events(d, "rank_restored"), d["events"]
    back = time.time()
    res = pool.vsdk("local", "restart", "agent-0")
    assert res.returncode == 0, res.stderr.decode()
    d = finish(pool, job, ref)
    mismatched = {agent_id(pool, name) for name in others}
    for e in events(d, "rank_restored"):
        assert e["time"] >= back, f"restored while only mismatched agents were up: {e}"
    for r in d["ranks"]:
        if events(d, "rank_restored", r["rank"]) and not events(d, "rank_replaying", r["rank"]):
            assert r["agent"] not in mismatched, (r, d["events"])


def test_rank_killed_with_its_checkpoint_in_flight_restores_from_it(pool: Pool) -> None:
    ref = reference(4, "600")
    job = submit(pool, 4, "600")  # no periodic checkpoints: the ordered one is the only one
    wait_until(pool, job, all_running, "all ranks running")
    pid = rank_pid(pool, 1, job)

    def kill_at_the_fork() -> None:
        wait_clone(pool, job, pid)
        os.kill(pid, signal.SIGKILL)  # right after the fork, before the image is stored

    # The watch starts before the order: the clone lives a few hundred ms (CRIU dumps 5 MB in
    # ~0.15 s), less than `vsdk checkpoint` may take to return on a busy machine.
    with ThreadPoolExecutor(1) as watch:
        killed = watch.submit(kill_at_the_fork)
        checkpoint_now(pool, job, 1)
        killed.result()
    d = finish(pool, job, ref)
    made = [ckpt_id(e["message"]) for e in events(d, "checkpoint", 1)]
    restored = [ckpt_id(e["message"]) for e in events(d, "rank_restored", 1)]
    assert len(made) == 1, d["events"]
    assert restored == made, d["events"]  # not replayed from the beginning
    assert not events(d, "rank_replaying", 1), d["events"]
    lost = events(d, "rank_lost", 1)
    assert len(lost) == 1, d["events"]
    # The loss was reported after the image was committed, not before.
    committed = events(d, "checkpoint", 1)[0]
    assert committed["time"] <= lost[0]["time"], d["events"]


def test_stopping_agent_checkpoints_its_ranks_before_it_leaves(pool: Pool) -> None:
    """A volunteer's agent told to stop (SIGTERM: the volunteer quits, or the machine goes to
    sleep) checkpoints its ranks before it stops them: their replacements restore from those
    images. A local pool's agents stop at once (`leave_checkpoint_grace = 0`): the agents get
    a volunteer's grace in their config files and are started again with it."""
    ref = reference(4, "600")
    names = [p["name"] for p in pool.pids() if p["name"].startswith("agent-")]
    for name in names:
        os.kill(pool.pid_of(name), signal.SIGKILL)
        config = pool.home / "state" / "local-pool" / name / "config.toml"
        kept = [
            line
            for line in config.read_text().splitlines()
            if not line.startswith("leave_checkpoint_grace")
        ]
        config.write_text("\n".join([*kept, "leave_checkpoint_grace = 30.0", ""]))
        res = pool.vsdk("local", "restart", name)
        assert res.returncode == 0, res.stderr.decode()
    wait_agents(pool, len(names))
    job = submit(pool, 4, "600")  # no periodic checkpoints: only those of the leaving agent
    wait_until(pool, job, lambda d: ended(d) or b"step 30:" in output(pool, job), "progress")
    d = wait_until(pool, job, lambda d: ended(d) or all_running(d), "all ranks running")
    assert not ended(d), d["events"]
    host = next(r["agent"] for r in d["ranks"] if r["rank"] == 1)
    leaving = next(name for name in names if agent_id(pool, name) == host)
    mine = sorted(r["rank"] for r in d["ranks"] if r["agent"] == host)
    end_process(pool.pid_of(leaving), signal.SIGTERM, 60)
    d = finish(pool, job, ref)
    log = (pool.home / "state" / "local-pool" / "logs" / f"{leaving}.log").read_text()
    assert f"leaving: {len(mine)} of {len(mine)} rank(s) checkpointed" in log, log[-3000:]
    assert not events(d, "checkpoint_failed"), d["events"]
    assert sorted({e["rank"] for e in events(d, "checkpoint")}) == mine, d["events"]
    for rank in mine:
        # Only the leaving agent's checkpoint was taken; the rank was lost after it was stored
        # and restored from it. (A lease handed to an agent as it was killed above may have
        # cost the rank an incarnation before: that loss comes earlier and is not checked.)
        (made,) = events(d, "checkpoint", rank)
        lost = events(d, "rank_lost", rank)
        assert lost and made["time"] <= lost[-1]["time"], d["events"]
        restored = events(d, "rank_restored", rank)
        assert restored and ckpt_id(restored[-1]["message"]) == ckpt_id(made["message"]), d
        assert restored[-1]["time"] >= made["time"], d["events"]
        assert not [e for e in events(d, "rank_replaying", rank) if e["time"] > made["time"]], d
