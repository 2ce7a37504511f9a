"""mpi4py's own demo programs (from the mpi4py 4.1.2 sdist), unmodified, with 4 ranks on a local
pool: their output through `vsdk submit` equals real `mpiexec -n 4 python X.py` (Debian's MPICH
with a real mpi4py built against it), run from the demo's own directory.

Only what legitimately differs between two runs is normalized, each by a named function below:
processor names (`_hosts`), timings (`_timings`), and the order in which lines of different
ranks reach the terminal (`_sentences`, `_spliced_census`). Nothing a rank computes is
normalized.

mpi-ref-v1 (examples of "MPI - The Complete Reference", vol. 1): the chapter 2 files are
point-to-point and collectives, and are in; every chapter 3 file builds derived datatypes
(indexed, struct, vector, hvector, hindexed: ex-3.01 to ex-3.13), which vpool's runtime does not
implement, and is out. They print nothing: they pass when every rank's assertions hold, i.e. the
job exits 0 with no output, as under MPICH.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from conftest import Pool

REPO = Path(__file__).resolve().parents[2]
MPI4PY_VERSION = "4.1.2"
RANKS = 4

pytestmark = pytest.mark.slow


def mpi4py_sdist() -> Path:
    """The unpacked mpi4py sdist under .cache/sdist, downloaded there first if missing."""
    cache = REPO / ".cache" / "sdist"
    root = cache / f"mpi4py-{MPI4PY_VERSION}"
    if (root / "demo").is_dir():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                # Only mpi4py as source: its build requirements (Cython...) as wheels, which
                # pip installs to read its metadata, instead of compiling Cython for minutes.
                "--no-binary",
                "mpi4py",
                "--no-deps",
                "--dest",
                tmp,
                f"mpi4py=={MPI4PY_VERSION}",
            ],
            capture_output=True,
            timeout=600,
            check=False,
        )
        assert res.returncode == 0, f"pip download failed:\n{res.stderr.decode()}"
        archive = Path(tmp) / f"mpi4py-{MPI4PY_VERSION}.tar.gz"
        unpacked = Path(tmp) / "unpacked"
        with tarfile.open(archive) as tf:
            tf.extractall(unpacked, filter="data")
        # A rename, so a concurrent or interrupted run never sees half a tree.
        try:
            (unpacked / root.name).rename(root)
        except OSError:
            if not (root / "demo").is_dir():
                raise
    return root


@pytest.fixture(scope="module")
def demo() -> Path:
    return mpi4py_sdist() / "demo"


# -- running both ways -----------------------------------------------------------------------


def mpich(program: Path, *, cwd: Path, stdin: bytes = b"") -> subprocess.CompletedProcess:
    mpiexec = shutil.which("mpiexec")
    assert mpiexec, "scripts/test installs Debian's mpich: mpiexec is missing"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VPOOL")}
    return subprocess.run(
        [mpiexec, "-n", str(RANKS), sys.executable, str(program)],
        input=stdin,
        capture_output=True,
        timeout=180,
        env=env,
        check=False,
        cwd=cwd,
    )


def vpool(pool: Pool, program: Path, *args: str) -> subprocess.CompletedProcess:
    res = pool.vsdk("submit", str(program), "--ranks", str(RANKS), *args, "--wait")
    # vsdk's own progress lines ("vsdk: job 7 running") go to stderr with the ranks' stderr.
    res.stderr = b"".join(
        ln for ln in res.stderr.splitlines(keepends=True) if not ln.startswith(b"vsdk: ")
    )
    return res


def both(pool: Pool, program: Path, *args: str, stdin: bytes = b"", tmp: Path | None = None):
    """(vpool, mpich) runs of ``program``; ``args`` are vsdk options (--input...)."""
    if stdin:
        assert tmp is not None
        stdin_file = tmp / "stdin.txt"
        stdin_file.write_bytes(stdin)
        args = (*args, "--stdin", str(stdin_file))
    ours = vpool(pool, program, *args)
    ref = mpich(program, cwd=program.parent, stdin=stdin)
    assert ref.returncode == 0, f"mpiexec failed:\n{ref.stderr.decode()}"
    assert ours.returncode == 0, f"vpool failed:\n{ours.stderr.decode()}\n{pool.logs()}"
    return ours, ref


# -- normalizations --------------------------------------------------------------------------

HELLO = re.compile(rb"Hello, World! I am process (\d+) of (\d+) on (.+?)\.(?=Hello|\n|$)")


def _hosts(out: bytes) -> bytes:
    """MPI.Get_processor_name() is the machine's name: whichever machine ran the rank."""
    return HELLO.sub(rb"Hello, World! I am process \1 of \2 on <host>.", out)


def _sentences(out: bytes) -> list[bytes]:
    """The greetings, sorted. Ranks print at the same time, so their lines reach the terminal in
    any order under both launchers; MPICH even splices them mid-line (it forwards each rank's
    pipe as bytes arrive), hence sentences rather than lines."""
    return sorted(m.group(0) for m in HELLO.finditer(_hosts(out)))


def _timings(out: bytes) -> bytes:
    """Wall-clock times ("0.20 seconds", unittest's "in 1.166s") differ from run to run."""
    out = re.sub(rb"\d+\.\d+ seconds", b"<t> seconds", out)
    return re.sub(rb"(Ran \d+ tests?) in \d+\.\d+s", rb"\1 in <t>s", out)


def _unittest_summary(err: bytes) -> Counter:
    """What the 4 ranks' unittest runners reported, read from whole lines (vpool's output)."""
    err = _timings(err)
    counts = Counter(re.findall(rb"Ran \d+ tests? in <t>s", err))
    for word in (b"OK", b"FAILED", b"ERROR", b"FAIL", b"skipped"):
        counts[word] = len(re.findall(rb"\b" + word + rb"\b", err))
    counts[b"."] = err.count(b".")
    return counts


def _spliced_census(err: bytes) -> Counter:
    """The bytes of an output whose writes MPICH may splice anywhere: with PYTHONUNBUFFERED,
    unittest writes "OK" and its newline separately, and another rank's "OK" can land between
    them ("OKOK"). Only the multiset of bytes survives every interleaving; digits are left out
    because they carry the timings."""
    return Counter(re.sub(rb"\d", b"", err))


def _assert_whole_lines(out: bytes, lines: list[bytes]) -> None:
    """vpool merges ranks' output by whole lines: every greeting is a line of its own."""
    assert sorted(out.splitlines()) == lines, out


# -- the demos -------------------------------------------------------------------------------


def test_helloworld(pool: Pool, demo: Path) -> None:
    ours, ref = both(pool, demo / "helloworld.py")
    assert _sentences(ours.stdout) == _sentences(ref.stdout)
    assert len(_sentences(ours.stdout)) == RANKS
    _assert_whole_lines(_hosts(ours.stdout), _sentences(ours.stdout))


def test_sequential(pool: Pool, demo: Path) -> None:
    # Seq makes the ranks print one after the other (a token passed with Send/Recv), but
    # neither launcher promises that lines of different ranks reach the terminal in the order
    # they were printed (each rank's output travels its own way), so the order is not compared.
    seq = demo / "sequential"
    ours, ref = both(pool, seq / "test_seq.py", "--input", str(seq / "seq.py"))
    assert _sentences(ours.stdout) == _sentences(ref.stdout)
    assert len(_sentences(ours.stdout)) == RANKS
    _assert_whole_lines(_hosts(ours.stdout), _sentences(ours.stdout))


@pytest.mark.parametrize(
    "stdin",
    [b"10\n100\n1000\n0\n", b"5\n-3\n"],
    ids=["ends-with-0", "negative-means-0"],
)
def test_compute_pi_reads_n_from_stdin_until_0(
    pool: Pool, demo: Path, tmp_path: Path, stdin: bytes
) -> None:
    # Rank 0 prompts (no newline), reads n, all ranks get it by Bcast; n <= 0, or anything
    # int() rejects (EOF included), ends the loop. Only rank 0 prints: the bytes must be equal.
    ours, ref = both(pool, demo / "compute-pi" / "cpi-cco.py", stdin=stdin, tmp=tmp_path)
    assert ours.stdout == ref.stdout
    assert ours.stdout.count(b"pi is approximately") == stdin.count(b"\n") - 1


def test_compute_pi_stops_at_end_of_input(pool: Pool, demo: Path, tmp_path: Path) -> None:
    ours, ref = both(pool, demo / "compute-pi" / "cpi-cco.py", stdin=b"100\n200", tmp=tmp_path)
    assert ours.stdout == ref.stdout
    assert ours.stdout.count(b"pi is approximately") == 2


def test_mandelbrot_prints_timings(pool: Pool, demo: Path) -> None:
    # Without matplotlib (not a dependency) the demo's only output is rank 0's table of
    # per-task wall-clock times; the image itself is checked by the next test.
    ours, ref = both(pool, demo / "mandelbrot" / "mandelbrot.py")
    assert _timings(ours.stdout) == _timings(ref.stdout)
    assert ours.stdout.count(b"wall clock time:") == RANKS


DIGEST_DRIVER = '''\
"""Run the unmodified mandelbrot demo, then print a digest of the image rank 0 gathered."""
import hashlib
import runpy

ns = runpy.run_path("mandelbrot.py", run_name="__main__")
if "M" in ns:
    image = ns["M"]
    digest = hashlib.sha256(image.tobytes()).hexdigest()
    print("image", image.shape, image.dtype, int(image.sum()), digest)
'''


def test_mandelbrot_image_is_mpichs(pool: Pool, demo: Path, tmp_path: Path) -> None:
    # The image (computed over Bcast, Gather and two Gathervs) is never printed: a driver that
    # runs the demo as is and then prints a digest of rank 0's M, the same file both ways.
    tree = tmp_path / "mandelbrot"
    tree.mkdir()
    shutil.copy(demo / "mandelbrot" / "mandelbrot.py", tree)
    (tree / "__main__.py").write_text(DIGEST_DRIVER)
    bundle = tmp_path / "mandelbrot.zip"
    with zipfile.ZipFile(bundle, "w") as zf:
        for f in sorted(tree.iterdir()):
            zf.write(f, f.name)
    ours = vpool(pool, bundle)
    assert ours.returncode == 0, f"{ours.stderr.decode()}\n{pool.logs()}"
    ref = mpich(tree / "__main__.py", cwd=tree)
    assert ref.returncode == 0, ref.stderr.decode()
    digest = [ln for ln in ours.stdout.splitlines() if ln.startswith(b"image ")]
    assert digest == [ln for ln in ref.stdout.splitlines() if ln.startswith(b"image ")]
    assert len(digest) == 1, ours.stdout


def test_reductions(pool: Pool, demo: Path) -> None:
    # unittest on every rank (80 tests: reductions, scans over COMM_WORLD, COMM_SELF and their
    # Dups with a point-to-point Intracomm subclass), reporting on each rank's stderr.
    red = demo / "reductions"
    ours, ref = both(pool, red / "test_reductions.py", "--input", str(red / "reductions.py"))
    assert ours.stdout == ref.stdout == b""
    summary = _unittest_summary(ours.stderr)
    assert _spliced_census(ours.stderr) == _spliced_census(ref.stderr)
    assert summary[b"OK"] == RANKS and summary[b"Ran 80 tests in <t>s"] == RANKS, ours.stderr
    assert summary[b"FAIL"] == summary[b"ERROR"] == summary[b"FAILED"] == 0, ours.stderr


MPI_REF_V1_IN = [
    "ex-2.01.py",  # Send/Recv with MPI.CHAR, Status fields and Get_count
    "ex-2.08.py",  # an exchange of messages
    "ex-2.16.py",  # Jacobi with Sendrecv, PROC_NULL neighbours, Allreduce(LAND)
    "ex-2.29.py",  # blocking Probe on ANY_SOURCE
    "ex-2.32.py",  # Jacobi with persistent requests (Send_init/Recv_init, Start, Waitall)
    "ex-2.34.py",  # ready- and synchronous-mode sends (Rsend, Ssend) against Irecvs
    "ex-2.35.py",  # Attach_buffer / Detach_buffer (buffered mode)
]
MPI_REF_V1_OUT = [f"ex-3.{n:02d}.py" for n in (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13)]


def test_mpi_ref_v1_selection_covers_every_file(demo: Path) -> None:
    files = sorted(p.name for p in (demo / "mpi-ref-v1").glob("ex-*.py"))
    assert files == sorted(MPI_REF_V1_IN + MPI_REF_V1_OUT)


@pytest.mark.parametrize("example", MPI_REF_V1_IN)
def test_mpi_ref_v1(pool: Pool, demo: Path, example: str) -> None:
    ours, ref = both(pool, demo / "mpi-ref-v1" / example)
    assert (ours.stdout, ours.stderr) == (ref.stdout, ref.stderr) == (b"", b"")
