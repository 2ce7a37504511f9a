"""CRIU pieces of checkpoints, with real CRIU and real processes.

The clone program forks the way the runtime does (own process group, fds 0-2 on /dev/null, an
open file in its cwd, polling its parent pid); the tests dump it, pack and unpack the image,
restore it in a fresh PID namespace and watch its exit status come back through
``restore_init``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import outcome
import pytest
import trio

from vpool.worker_agent import criu
from vpool.worker_agent.ckpt_image import ImageReader, ImageWriter, Stream

CRIU = shutil.which("criu") or "/usr/local/sbin/criu"
needs_criu = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists(CRIU), reason="needs root and CRIU"
)

CLONE_PROGRAM = r"""
import json, os, sys, time
rank_dir, mode, mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
data = expect = None
if mb:
    import numpy as np
    data = np.random.default_rng(0).random(mb * 131072)
    expect = float(data.sum())
r, w = os.pipe()
parent = os.getpid()
if os.fork() == 0:
    # As the runtime's clone does (mpi/checkpoint.py): CRIU refuses a session whose
    # leader is outside the PID namespace (sid 0), as a sandbox's may be.
    if os.getsid(0) == 0:
        os.setsid()
    else:
        os.setpgid(0, 0)
    os.chdir(os.path.join(rank_dir, "work"))
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    os.close(r)
    journal = open("journal.txt", "a")
    journal.write("forked\n")
    journal.flush()
    os.write(w, b"x")
    os.close(w)
    deadline = time.monotonic() + 120
    while os.getppid() == parent:
        if time.monotonic() > deadline:
            os._exit(99)
        time.sleep(0.01)
    journal.write("restored\n")
    journal.flush()
    ok = data is None or float(data.sum()) == expect
    try:
        group = (open("/proc/self/autogroup").read().split() or ["default"])[0]
    except OSError:
        group = None
    info = {"ppid": os.getppid(), "parent": parent, "data_ok": ok, "autogroup": group}
    info.update(pid=os.getpid(), sid=os.getsid(0), own_group=os.getpgid(0) == os.getpid())
    with open("restored.tmp", "w") as f:
        json.dump(info, f)
    os.rename("restored.tmp", "restored.json")
    if mode == "wait":
        time.sleep(120)
    os._exit(7)
os.close(w)
assert os.read(r, 1) == b"x"
print(os.getpid(), flush=True)
sys.stdin.read()
"""


# -- fingerprint --------------------------------------------------------------------------


def test_tree_hashing(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.so").write_bytes(b"a" * 100)
    (tmp_path / "sub" / "b.so.1").write_bytes(b"b" * 100)
    (tmp_path / "c.py").write_bytes(b"c")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "d.so").write_bytes(b"d")
    pattern = re.compile(r"\.so(\.\d+)*$")

    def fingerprint(salt: str = "", rank_root: str = "/r") -> str:
        files = criu.tree_files(str(tmp_path), pattern)
        return criu.combine(criu.hash_files(files), rank_root=rank_root, salt=salt)

    files = sorted(criu.tree_files(str(tmp_path), pattern))
    assert files == [str(tmp_path / "a.so"), str(tmp_path / "sub" / "b.so.1")]
    first = fingerprint()
    assert fingerprint() == first
    assert fingerprint(salt="other") != first
    assert fingerprint(rank_root="/elsewhere") != first

    target = tmp_path / "sub" / "b.so.1"
    target.write_bytes(b"B" * 100)
    st = target.stat()
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    changed = fingerprint()
    assert changed != first
    # The cache trusts (size, mtime): an edit that keeps both is not re-read.
    target.write_bytes(b"C" * 100)
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert fingerprint() == changed


@pytest.mark.large
def test_environment_fingerprint() -> None:
    started = time.monotonic()
    first, hashes = criu.environment_fingerprint(sys.executable, rank_root="/tmp/vpool-ranks")
    cold = time.monotonic() - started
    started = time.monotonic()
    again, _ = criu.environment_fingerprint(sys.executable, rank_root="/tmp/vpool-ranks")
    warm = time.monotonic() - started
    print(f"fingerprint: {len(hashes)} files, first call {cold:.2f} s, again {warm:.2f} s")
    assert again == first
    assert re.fullmatch(r"[0-9a-f]{64}", first)
    assert warm < 2
    assert os.path.realpath(sys.executable) in hashes
    assert str(Path(criu.__file__).resolve()) in hashes
    assert any("/libc.so" in path for path in hashes)
    assert any("lib-dynload" in path for path in hashes)
    assert any("/numpy/" in path for path in hashes)
    salted, _ = criu.environment_fingerprint(
        sys.executable, rank_root="/tmp/vpool-ranks", salt="agent-2"
    )
    assert salted != first


# -- small pieces -------------------------------------------------------------------------


def test_read_status(tmp_path: Path) -> None:
    status = tmp_path / "status.json"
    assert criu.read_status(status) is None
    for text, expected in [
        ('{"code": 3}', 3),
        ('{"code": 0}', 0),
        ('{"signal": 9}', -9),
        ("{}", None),
        ("[1]", None),
        ('{"code": "x"}', None),
        ("not json", None),
    ]:
        status.write_text(text)
        assert criu.read_status(status) == expected, text


def test_restore_command(tmp_path: Path) -> None:
    command = criu.restore_command(tmp_path / "img", tmp_path / "s", criu="/x/criu", python="py")
    assert command[:4] == ["unshare", "--pid", "--fork", "--mount-proc"]
    assert command[4:] == [
        "py",
        "-m",
        "vpool.worker_agent.restore_init",
        "--criu",
        "/x/criu",
        "--images",
        str(tmp_path / "img"),
        "--status",
        str(tmp_path / "s"),
    ]


@pytest.mark.large
def test_process_tree_pids() -> None:
    # The printed pid is the child's child. Its command line is not checked: Popen returns when
    # the vfork'd child releases the parent's memory, which is inside execve and before the
    # kernel has set the new command line (CI read b"" there once).
    script = (
        "import subprocess, sys; p = subprocess.Popen(['sleep', '60']); "
        "print(p.pid, flush=True); sys.stdin.read()"
    )
    with subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as proc:
        assert proc.stdout is not None
        grandchild = int(proc.stdout.readline())
        assert criu.process_tree_pids(proc.pid) == [grandchild]
        assert Path(f"/proc/{grandchild}/stat").read_text().split(") ")[1].split()[1] == str(
            proc.pid
        )
        os.kill(grandchild, signal.SIGKILL)
        proc.kill()
    assert criu.process_tree_pids(proc.pid) == []


@needs_criu
@pytest.mark.large
async def test_criu_check() -> None:
    version = await criu.criu_check(CRIU)
    assert re.fullmatch(r"\d+\.\d+(\.\d+)?", version), version
    assert await criu.criu_check("/nonexistent/criu") == ""
    assert await criu.criu_check("false") == ""


@needs_criu
@pytest.mark.large
async def test_dump_failure(tmp_path: Path) -> None:
    with pytest.raises(criu.CriuError, match="criu dump of 4194305 failed"):
        await criu.dump(4_194_305, tmp_path / "img", criu=CRIU)


@pytest.mark.large
async def test_dump_runs_criu_nicer_than_the_agent(tmp_path: Path) -> None:
    """The agent's ``checkpoint_nice`` reaches the CRIU process itself: a stand-in for criu
    writes down its own niceness and arguments, and fails like a dump of a missing pid."""
    tool = tmp_path / "criu"
    seen = tmp_path / "seen"
    tool.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        "nice = os.getpriority(os.PRIO_PROCESS, 0)\n"
        f"open({str(seen)!r}, 'w').write(f'{{nice}} {{sys.argv[1]}}')\n"
        "sys.exit(1)\n"
    )
    tool.chmod(0o755)
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    for nice, want in ((0, mine), (6, min(mine + 6, 19))):
        with pytest.raises(criu.CriuError, match="failed \\(exit 1\\)"):
            await criu.dump(4_194_305, tmp_path / "img", criu=str(tool), nice=nice)
        assert seen.read_text() == f"{want} dump"


def test_pages_pipe_reads_what_a_writer_wrote(tmp_path: Path) -> None:
    """Before any writer opens the FIFO there is no end yet; the writer's close is the end."""
    pipe = criu.PagesPipe(tmp_path)
    data = os.urandom(3 << 20)
    go = threading.Event()

    def write() -> None:
        go.wait(10)
        with open(tmp_path / criu.PAGES_NAME, "wb") as f:  # as CRIU opens it
            f.write(data)

    writer = threading.Thread(target=write)
    writer.start()
    buf = memoryview(bytearray(1 << 20))
    got = bytearray()
    go.set()
    while n := pipe.read_into(buf):
        got += buf[:n]
    writer.join()
    pipe.ended(None)
    pipe.wait_dump()
    pipe.close()
    assert bytes(got) == data and pipe.size == len(data)


def test_pages_pipe_of_a_dump_that_failed_before_writing(tmp_path: Path) -> None:
    pipe = criu.PagesPipe(tmp_path)
    pipe.ended(criu.CriuError("criu dump of 1 failed"))
    with pytest.raises(criu.CriuError, match="dump of 1 failed"):
        pipe.wait_pages()
    with pytest.raises(criu.CriuError, match="dump of 1 failed"):
        pipe.wait_dump()
    pipe.close()
    (tmp_path / "x").mkdir()
    quiet = criu.PagesPipe(tmp_path / "x")
    quiet.ended(None)  # ended without writing and without an error: an empty stream
    assert quiet.read_into(memoryview(bytearray(10))) == 0
    quiet.close()


def test_pages_pipe_abandoned_unblocks_the_reader(tmp_path: Path) -> None:
    pipe = criu.PagesPipe(tmp_path)
    raised: list[BaseException] = []

    def read() -> None:
        try:
            pipe.read_into(memoryview(bytearray(10)))
        except criu.CriuError as exc:
            raised.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    pipe.abandoned = True
    reader.join(10)
    assert not reader.is_alive() and "abandoned" in str(raised[0])
    pipe.close()


# -- dump, pack, unpack, restore ----------------------------------------------------------


@dataclass
class Checkpoint:
    images: Path
    rank_dir: Path
    parent: int
    timings: dict[str, float] = field(default_factory=dict)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Processes a test starts; whatever is left is killed (its process group too)."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.kill()
        proc.wait(timeout=30)
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def make_checkpoint(
    tmp_path: Path,
    processes: list[subprocess.Popen[bytes]],
    mode: str,
    mb: int = 0,
    *,
    streamed: bool = False,
) -> Checkpoint:
    """Fork a clone, dump it, let its parent die, and bring the image back through the
    image stream at the same rank directory (as a restoring agent does). ``streamed``: CRIU
    writes the pages into a ``PagesPipe`` packed while the dump runs, as the agent does."""
    rank_dir = tmp_path / "rank"
    (rank_dir / "work").mkdir(parents=True)
    (rank_dir / "home").mkdir()
    program = tmp_path / "clone_program.py"
    program.write_text(CLONE_PROGRAM)
    parent = subprocess.Popen(
        [sys.executable, str(program), str(rank_dir), mode, str(mb)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        process_group=0,  # as the agent starts a rank
    )
    processes.append(parent)
    assert parent.stdout is not None
    line = parent.stdout.readline()
    assert line.strip() == str(parent.pid).encode()
    clone = next(pid for pid in criu.process_tree_pids(parent.pid))
    timings: dict[str, float] = {}

    dumped = tmp_path / "dumped"
    writer = ImageWriter(bytes(32), job=1, rank=0, ckpt=1)
    stored = tmp_path / "stored.img"
    if streamed:
        dumped.mkdir()
        pipe = criu.PagesPipe(dumped)
        stream = Stream(criu.PAGES_NAME, pipe.read_into)
        packed: list[outcome.Outcome[None]] = []

        def pack() -> None:
            with stored.open("wb") as f:
                for piece in writer.pack(dumped, rank_dir, streams=[stream], then=pipe.wait_dump):
                    f.write(piece)

        packer = threading.Thread(target=lambda: packed.append(outcome.capture(pack)))
        packer.start()
        started = time.monotonic()
        try:
            timings["dump"] = trio.run(partial(criu.dump, clone, dumped, criu=CRIU))
        except BaseException as exc:
            pipe.ended(exc)
            raise
        else:
            pipe.ended(None)
        finally:
            packer.join()
            pipe.close()
        packed[0].unwrap()
        timings["dump+pack"] = time.monotonic() - started
        timings["pipe_mb"] = pipe.size / 1e6
        assert not (dumped / criu.PAGES_NAME).is_file()  # still the FIFO: nothing on disk
        parent.kill()
        parent.wait(timeout=30)
    else:
        timings["dump"] = trio.run(partial(criu.dump, clone, dumped, criu=CRIU))
        parent.kill()
        parent.wait(timeout=30)
        started = time.monotonic()
        with stored.open("wb") as f:
            for piece in writer.pack(dumped, rank_dir):
                f.write(piece)
        timings["pack"] = time.monotonic() - started
    timings["image_mb"] = writer.size / 1e6
    shutil.rmtree(rank_dir)
    shutil.rmtree(dumped)

    def pieces() -> Iterator[bytes]:
        with stored.open("rb") as f:
            while piece := f.read(1 << 20):
                yield piece

    started = time.monotonic()
    images = tmp_path / "restored-img"
    reader = ImageReader(bytes(32), job=1, rank=0, ckpt=1, size=writer.size, digest=writer.digest)
    reader.unpack(pieces(), images, rank_dir)
    timings["unpack"] = time.monotonic() - started
    assert (rank_dir / "work" / "journal.txt").read_text() == "forked\n"
    return Checkpoint(images, rank_dir, parent.pid, timings)


def _autogroup() -> str | None:
    try:
        # Empty for the kernel's default group (a session that never called setsid).
        return (Path("/proc/self/autogroup").read_text().split() or ["default"])[0]
    except OSError:
        return None


def start_restore(
    checkpoint: Checkpoint, status: Path, processes: list[subprocess.Popen[bytes]]
) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        criu.restore_command(checkpoint.images, status, criu=CRIU),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        process_group=0,  # as the agent starts a restore
    )
    processes.append(proc)
    return proc


def finish(proc: subprocess.Popen[bytes]) -> int:
    out, err = proc.communicate(timeout=60)
    print(out.decode(errors="replace"), err.decode(errors="replace"))
    return proc.returncode


def wait_for_file(path: Path, proc: subprocess.Popen[bytes]) -> dict[str, object]:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert proc.poll() is None, f"restore ended early: {finish(proc)}"
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)
    result: dict[str, object] = json.loads(path.read_text())
    return result


@needs_criu
@pytest.mark.parametrize("streamed", [False, True], ids=["file", "pipe"])
def test_dump_restore_exit_code(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]], streamed: bool
) -> None:
    checkpoint = make_checkpoint(tmp_path, processes, "exit", mb=20, streamed=streamed)
    status = tmp_path / "status.json"
    proc = start_restore(checkpoint, status, processes)
    assert finish(proc) == 7
    assert criu.read_status(status) == 7
    restored = json.loads((checkpoint.rank_dir / "work" / "restored.json").read_text())
    assert restored["parent"] == checkpoint.parent
    assert restored["ppid"] != checkpoint.parent
    assert restored["data_ok"] is True  # 20 MB of numbers, through the pipe or the file
    assert restored["own_group"] is True
    if os.getsid(0) == 0:
        # This test runs in a PID namespace whose session leader is outside (a sandbox's):
        # the clone led a session of its own, and it comes back as its leader.
        assert restored["sid"] == restored["pid"]
    else:
        # In the restoring session (whose leader is outside the namespace: sid 0 there), and
        # so in the restorer's scheduler group (--shell-job).
        assert restored["sid"] == 0
        assert restored["autogroup"] == _autogroup()
    if streamed:
        assert checkpoint.timings["pipe_mb"] > 20
    # The file the clone held open came back with it, at its offset.
    assert (checkpoint.rank_dir / "work" / "journal.txt").read_text() == "forked\nrestored\n"


@needs_criu
def test_restored_killed_by_host_pid(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    checkpoint = make_checkpoint(tmp_path, processes, "wait")
    status = tmp_path / "status.json"
    proc = start_restore(checkpoint, status, processes)
    wait_for_file(checkpoint.rank_dir / "work" / "restored.json", proc)
    host = criu.restored_host_pid(proc.pid, checkpoint.images)
    assert host is not None
    assert host in criu.process_tree_pids(proc.pid)
    assert b"clone_program" in Path(f"/proc/{host}/cmdline").read_bytes()
    os.kill(host, signal.SIGKILL)
    assert finish(proc) == 128 + signal.SIGKILL
    assert criu.read_status(status) == -signal.SIGKILL


@needs_criu
def test_process_group_signal_reaches_restored(
    tmp_path: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    checkpoint = make_checkpoint(tmp_path, processes, "wait")
    status = tmp_path / "status.json"
    proc = start_restore(checkpoint, status, processes)
    wait_for_file(checkpoint.rank_dir / "work" / "restored.json", proc)
    os.killpg(proc.pid, signal.SIGTERM)
    assert finish(proc) == 128 + signal.SIGTERM
    assert criu.read_status(status) == -signal.SIGTERM


@needs_criu
@pytest.mark.large
def test_restore_failure_writes_no_status(tmp_path: Path) -> None:
    images = tmp_path / "img"
    images.mkdir()
    status = tmp_path / "status.json"
    result = subprocess.run(
        criu.restore_command(images, status, criu=CRIU), capture_output=True, timeout=60
    )
    assert result.returncode == 2
    assert b"restore failed" in result.stderr
    assert not status.exists()


@needs_criu
@pytest.mark.slow
@pytest.mark.exclusive  # the timings it prints are worth reading only on an idle machine
def test_numpy_200mb_timings(tmp_path: Path, processes: list[subprocess.Popen[bytes]]) -> None:
    checkpoint = make_checkpoint(tmp_path, processes, "exit", mb=200)
    status = tmp_path / "status.json"
    started = time.monotonic()
    proc = start_restore(checkpoint, status, processes)
    assert finish(proc) == 7
    checkpoint.timings["restore"] = time.monotonic() - started
    restored = json.loads((checkpoint.rank_dir / "work" / "restored.json").read_text())
    assert restored["data_ok"] is True
    print("timings (s, image MB):", {k: round(v, 2) for k, v in checkpoint.timings.items()})


@needs_criu
@pytest.mark.large
async def test_criu_check_refuses_a_criu_others_could_replace(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A dump of a sandboxed rank runs CRIU as root: one in a directory others can write
    (tmp_path is under /tmp) disables checkpoints at start, saying why."""
    copy = tmp_path / "criu"
    shutil.copy(CRIU, copy)
    copy.chmod(0o755)
    assert await criu.criu_check(str(copy)) == ""
    assert "writable by others" in caplog.text
