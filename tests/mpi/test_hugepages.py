"""Huge pages back after a checkpoint's fork: ``vpool.mpi.hugepages``."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from vpool.mpi import hugepages

SMAPS = """\
7f0000000000-7f0000a00000 rw-p 00000000 00:00 0
Size:              10240 kB
VmFlags: rd wr mr mw me ac hg
7f1000000000-7f1000a00000 rw-p 00000000 00:00 0
Size:              10240 kB
VmFlags: rd wr mr mw me ac
7f2000100000-7f2000a00000 rw-p 00000000 00:00 0
VmFlags: rd wr mr mw me ac hg nh
7f3000000000-7f3000200000 rw-p 00000000 00:00 0
VmFlags: rd wr mr mw me ac hg
7f4000100000-7f4000b00000 rw-p 00000000 00:00 0 [heap]
VmFlags: rd wr mr mw me ac hg
7f5000100000-7f5000b00000 r--p 00000000 08:01 42 /usr/lib/libx.so
VmFlags: rd mr mw me
7f6000100000-7f6000900000 rw-s 00000000 00:01 7 /dev/zero (deleted)
VmFlags: rd wr sh mr mw me ms hg
7f7000100000-7f7000a00000 rw-p 00000000 00:00 0
VmFlags: rd wr mr mw me ac hg
"""


def test_regions_chosen() -> None:
    madvise = hugepages.regions(SMAPS, "madvise")
    # The hg region, and the unaligned one cut to whole 2 MiB pages; not the region without
    # hg, the nh one, the small one, the heap, a file, a shared mapping.
    assert madvise == [(0x7F0000000000, 0x7F0000A00000), (0x7F7000200000, 0x7F7000A00000)]
    always = hugepages.regions(SMAPS, "always")
    assert (0x7F1000000000, 0x7F1000A00000) in always
    assert len(always) == 3


def _anon_huge_kb() -> int:
    with open("/proc/self/smaps") as f:
        return sum(int(kb) for kb in re.findall(r"AnonHugePages:\s+(\d+) kB", f.read()))


# The machine to itself: the kernel finds free huge pages for the collapse only when nothing
# else is filling and freeing memory (another pytest worker's test; under two, it found none).
@pytest.mark.exclusive
@pytest.mark.large
def test_collapse_after_a_fork_writes_everything() -> None:
    """The real thing: a forked child holds the pages while the parent rewrites its array,
    which splits its huge pages; the collapse gets them back."""
    if hugepages._thp_mode() == "never":
        pytest.skip("transparent huge pages are off on this machine")
    a = np.ones(64 << 17)  # 64 MiB, numpy asks for huge pages (MADV_HUGEPAGE)
    before = _anon_huge_kb()
    assert before >= 32 << 10, "numpy's big array is not on huge pages to begin with"
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        os.read(r, 1)  # wait until the parent has written everything
        os._exit(0)
    os.close(r)
    a += 1  # copy-on-write: split into 4 KiB pages
    split = _anon_huge_kb()
    os.close(w)
    os.waitpid(pid, 0)
    assert split < before // 2
    assert hugepages.collapse_huge_pages() >= 1
    assert _anon_huge_kb() >= 60 << 10
    assert float(a[12345]) == 2.0
