"""``MPI.buffer`` (mpi/mpibuffer.py): the type in-process, then through real rank processes
(``programs/mpibuffer.py``: Alloc_mem buffers sent, received into, attached and freed)."""

from __future__ import annotations

import array
import ctypes
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import trio

from vpool.mpi.mpibuffer import buffer

PROGRAM = Path(__file__).resolve().parent / "programs" / "mpibuffer.py"


def test_empty_buffer_has_no_address() -> None:
    buf = buffer()
    assert (buf.address, buf.obj, buf.nbytes, len(buf), buf.readonly) == (0, None, 0, 0, False)
    m = memoryview(buf)
    assert (m.format, m.ndim, m.shape, m.strides, m.readonly) == ("B", 1, (0,), (1,), False)


@pytest.mark.parametrize("bad", [None, 0, 0.0, [], ()])
def test_non_buffers_are_rejected(bad: object) -> None:
    with pytest.raises(TypeError):
        buffer(bad)
    with pytest.raises(TypeError):
        buffer.frombuffer(bad)


def test_buffer_aliases_the_exporting_object() -> None:
    obj = array.array("i", [1, 2, 3])
    buf = buffer(obj)
    addr, n = obj.buffer_info()
    assert buf.obj is obj and buf.address == addr and buf.nbytes == n * obj.itemsize
    assert (buf.format, buf.itemsize, memoryview(buf).format) == ("B", 1, "B")
    buf[0:4] = array.array("i", [7])
    assert obj[0] == 7
    assert np.frombuffer(buf, "i").tolist() == [7, 2, 3]


def test_readonly_follows_the_object_and_the_request() -> None:
    assert buffer(b"abc").readonly and memoryview(buffer(b"abc")).readonly
    with pytest.raises(TypeError):
        buffer(b"abc")[:] = 0
    with pytest.raises(BufferError):
        buffer.frombuffer(b"abc")
    rw = buffer.frombuffer(bytearray(b"abc"))
    ro = rw.toreadonly()
    assert ro.readonly and not rw.readonly
    assert (ro.address, ro.obj, ro.nbytes) == (rw.address, rw.obj, rw.nbytes)


def test_items_and_slices_behave_like_mpi4py() -> None:
    buf = buffer.allocate(8, clear=True)
    assert buf.address != 0 and buf.tobytes() == bytes(8)
    buf[:] = 255
    buf[1:4] = b"abc"
    buf[-1] = 0
    assert list(buf) == [255, 97, 98, 99, 255, 255, 255, 0]
    assert isinstance(buf[1], int) and buf[1:4].tobytes() == b"abc" and buf[1:4].obj is buf
    assert buf[1:4].address == buf.address + 1
    for key, exc in [(8, IndexError), (slice(None, None, 2), IndexError), (None, TypeError)]:
        with pytest.raises(exc):
            buf[key]
        with pytest.raises(exc):
            buf[key] = 0
    with pytest.raises(ValueError):
        buf[0:1] = buf[1:3]
    with pytest.raises(OverflowError):
        buf[0] = 256
    with pytest.raises(NotImplementedError):
        del buf[0]


def test_no_arithmetic_identity_equality_no_pickle() -> None:
    a, b = buffer(bytearray(2)), buffer(bytearray(2))
    assert a == a and a != b and hash(a) == object.__hash__(a)
    with pytest.raises(TypeError):
        a + b
    with pytest.raises(TypeError):
        pickle.dumps(a)


def test_fromaddress_cast_and_release() -> None:
    obj = (ctypes.c_ubyte * 6)(*range(6))
    buf = buffer.fromaddress(ctypes.addressof(obj), 6)
    assert buf.obj is None and buf.address == ctypes.addressof(obj)
    buf[0] = 9
    assert obj[0] == 9
    assert buf.cast("B", (2, 3))[1, 2] == 5
    buf.release()
    assert (buf.address, buf.nbytes, buf.obj, buf.readonly) == (0, 0, None, False)
    assert buf.tobytes() == b""
    with pytest.raises(ValueError):
        buffer.fromaddress(0, 1)
    with pytest.raises(ValueError):
        buffer.fromaddress(ctypes.addressof(obj), -1)
    with pytest.raises(ValueError):
        buffer.allocate(-1)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.large
async def test_buffers_through_rank_processes(n: int) -> None:
    cmd = [sys.executable, "-m", "vpool.sdk.mpiexec", "-n", str(n), "--", str(PROGRAM)]
    with trio.fail_after(120):
        proc = await trio.run_process(
            cmd, stdin=subprocess.DEVNULL, capture_stdout=True, capture_stderr=True, check=False
        )
    out, err = proc.stdout.decode(), proc.stderr.decode()
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{err}"
    assert out == f"mpibuffer ok {n}\n", f"{out}\n{err}"
