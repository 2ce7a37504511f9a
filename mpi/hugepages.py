"""Putting a rank's big anonymous memory back on transparent huge pages (``MADV_COLLAPSE``).

A checkpoint forks the rank; while the clone lives, each page the rank writes is copied, and
a huge page written to is split into 4 KiB pages for it. ``fork()`` copies one page-table
entry per page, so the next checkpoint's pause grows from about 1 ms to 6 ms per 200 MB
(measured on the 2-core test machine). ``collapse_huge_pages`` asks the kernel (Linux 6.1 and
later) to rebuild huge pages synchronously in the regions that had asked for them
(``MADV_HUGEPAGE``, which numpy does for every array of 4 MiB or more), or in every large
anonymous region when the system's THP mode is ``always``. The call copies each region once
(about 60 ms of CPU per 200 MB): run it off the main thread. On older kernels, or with THP off,
it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno

MADV_COLLAPSE = 25  # <linux/mman.h>, Linux 6.1
HUGE = 2 << 20
MIN_REGION = 4 << 20  # smaller regions are not worth a collapse
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"

_unsupported = False


def _thp_mode() -> str:
    """``always``, ``madvise`` or ``never`` (the bracketed word of the sysfs file)."""
    try:
        with open(THP_ENABLED, encoding="ascii") as f:
            text = f.read()
    except OSError:
        return "never"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "never"


def regions(smaps: str, mode: str) -> list[tuple[int, int]]:
    """The 2 MiB-aligned (start, end) ranges of ``/proc/self/smaps`` text worth collapsing:
    anonymous, private, writable, at least ``MIN_REGION`` long, marked ``hg`` (or any, in
    ``always`` mode) and not ``nh``."""
    out: list[tuple[int, int]] = []
    current: tuple[int, int] | None = None
    for line in smaps.splitlines():
        head = line.split(None, 5)
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
            current = None
            start_s, _, end_s = head[0].partition("-")
            perms = head[1]
            path = head[5].strip() if len(head) > 5 else ""
            try:
                start, end = int(start_s, 16), int(end_s, 16)
            except ValueError:
                continue
            private_rw = perms.startswith("rw") and perms[3:4] == "p"
            if private_rw and not path and end - start >= MIN_REGION:
                current = (start, end)
        elif current is not None and line.startswith("VmFlags:"):
            flags = line.split()[1:]
            if "nh" not in flags and ("hg" in flags or mode == "always"):
                start = (current[0] + HUGE - 1) & ~(HUGE - 1)
                end = current[1] & ~(HUGE - 1)
                if end > start:
                    out.append((start, end))
            current = None
    return out


def collapse_huge_pages() -> int:
    """Collapse what ``regions`` finds in this process; the number of ranges collapsed. Never
    raises: this is an optimisation."""
    global _unsupported
    if _unsupported:
        return 0
    mode = _thp_mode()
    if mode == "never":
        return 0
    try:
        with open("/proc/self/smaps", encoding="ascii", errors="replace") as f:
            found = regions(f.read(), mode)
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
    except (OSError, AttributeError):
        return 0
    done = 0
    for start, end in found:
        if madvise(start, end - start, MADV_COLLAPSE) == 0:
            done += 1
            continue
        err = ctypes.get_errno()
        if err == errno.EINVAL:
            _unsupported = True  # a kernel without MADV_COLLAPSE
            break
        # EAGAIN/ENOMEM (no huge page free right now), EFAULT (unmapped meanwhile): go on.
    return done
