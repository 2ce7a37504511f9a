"""``vsdk mpiexec`` as a user types it: real ranks, real pipes (issue 18's small faults)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

VSDK = Path(sys.executable).parent / "vsdk"
SPLIT_WRITES = """
import os
from mpi4py import MPI
r = MPI.COMM_WORLD.Get_rank()
for i in range(300):
    os.write(1, b"rank %d line %03d: " % (r, i))  # a line in two writes,
    os.write(1, b"whole\\n")                       # as unbuffered print() does
    os.write(2, b"err %d-%03d " % (r, i))
    os.write(2, b"too\\n")
os.write(1, b"rank %d ends without a newline" % r)
"""


pytestmark = pytest.mark.large


def vsdk(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [str(VSDK), "mpiexec", *args],
        input=stdin if stdin is not None else b"",
        capture_output=True,
        timeout=120,
        check=False,
    )


def test_lines_of_different_ranks_are_never_spliced(tmp_path: Path) -> None:
    program = tmp_path / "split.py"
    program.write_text(SPLIT_WRITES)
    res = vsdk("-n", "4", "python", str(program))
    assert res.returncode == 0, res.stderr.decode()
    out = res.stdout.decode().splitlines()
    assert len(out) == 4 * 300 + 4
    whole = [line for line in out if re.fullmatch(r"rank \d line \d{3}: whole", line)]
    assert len(whole) == 1200, [line for line in out if line not in whole][:5]
    # Each rank's partial last line is shown once, on a line of its own.
    assert sorted(line for line in out if "ends" in line) == [
        f"rank {r} ends without a newline" for r in range(4)
    ]
    err = [line for line in res.stderr.decode().splitlines() if line.startswith("err")]
    assert len(err) == 1200 and all(re.fullmatch(r"err \d-\d{3} too", e) for e in err)


def test_stdin_file_goes_to_rank_0(tmp_path: Path) -> None:
    program = tmp_path / "echo.py"
    program.write_text(
        "import sys\nfrom mpi4py import MPI\n"
        "if MPI.COMM_WORLD.Get_rank() == 0:\n    print(sys.stdin.read().upper(), end='')\n"
    )
    data = tmp_path / "in.txt"
    data.write_text("from a file\n")
    res = vsdk("-n", "2", "--stdin", str(data), str(program))
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout == b"FROM A FILE\n"


def test_python_and_a_script_without_py(tmp_path: Path) -> None:
    program = tmp_path / "simulate"  # no .py, not executable
    program.write_text(
        "from mpi4py import MPI\nc = MPI.COMM_WORLD\nprint('sum', c.allreduce(c.Get_rank()))\n"
    )
    res = vsdk("-n", "2", "python", str(program))
    assert res.returncode == 0, res.stderr.decode()
    assert res.stdout.decode().splitlines() == ["sum 1", "sum 1"]
