"""``DirectFile``: images written around the page cache come back byte for byte."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from vpool.relay.directwrite import BUFFER, DirectFile


def pieces(data: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    out, at = [], 0
    while at < len(data):
        n = rng.choice([1, 4095, 65536, 1 << 20, BUFFER + 3])
        out.append(data[at : at + n])
        at += n
    return out


@pytest.mark.parametrize("size", [0, 1, BUFFER - 1, BUFFER, 2 * BUFFER + 12345])
@pytest.mark.parametrize("direct", [True, False])
def test_content_is_exact(tmp_path: Path, size: int, direct: bool) -> None:
    data = random.Random(size).randbytes(size)
    path = tmp_path / "image.part"
    f = DirectFile(path, direct=direct)
    for piece in pieces(data, size):
        f.write(memoryview(piece))
    f.finish()
    f.close()
    assert f.size == size
    assert path.read_bytes() == data
    assert os.stat(path).st_mode & 0o777 == 0o600


def test_direct_where_the_file_system_allows(tmp_path: Path) -> None:
    """On the test machine's disk the whole buffers bypass the page cache; the tail turns
    O_DIRECT off. A file system that refuses O_DIRECT (tmpfs before Linux 6.6) gets ordinary
    writes from the start."""
    path = tmp_path / "image.part"
    f = DirectFile(path)
    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError:
        assert not f.direct  # no O_DIRECT here: ordinary writes
        pytest.skip("this file system refuses O_DIRECT")
    assert f.direct  # the disk takes O_DIRECT: so must DirectFile
    f.write(bytes(BUFFER + 10))
    assert f.direct  # one whole buffer written directly
    f.finish()
    assert not f.direct  # the 10-byte tail went through the page cache
    f.close()
    assert path.stat().st_size == BUFFER + 10


def test_refuses_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "image.part"
    path.write_bytes(b"old")
    with pytest.raises(FileExistsError):
        DirectFile(path)
    assert path.read_bytes() == b"old"


@pytest.mark.parametrize("direct", [True, False])
def test_receive_fills_the_buffer_in_place(tmp_path: Path, direct: bool) -> None:
    """``receive(n)`` hands out views of the file's own buffer, whole buffers written as they
    fill; mixed with ``write``, the bytes land in order."""
    data = random.Random(7).randbytes(3 * BUFFER + 999)
    path = tmp_path / "image.part"
    f = DirectFile(path, direct=direct)
    at, sizes = 0, []
    for i, piece in enumerate(pieces(data, 7)):
        if i % 3 == 0:
            f.write(piece)
        else:
            got = 0
            for view in f.receive(len(piece)):
                view[:] = piece[got : got + len(view)]
                got += len(view)
                sizes.append(len(view))
            assert got == len(piece)
        at += len(piece)
    f.finish()
    f.close()
    assert at == len(data) and f.size == len(data)
    assert path.read_bytes() == data
    assert max(sizes) <= BUFFER and len(sizes) > 3
