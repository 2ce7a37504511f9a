"""``vpool.heap``: freed memory handed back to the system after a burst."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from vpool import heap

pytestmark = pytest.mark.large


def test_trim_and_resident_work_here() -> None:
    if heap._malloc_trim() is None:
        pytest.skip("this C library has no malloc_trim (not glibc)")
    assert heap.trim() is True
    assert heap.resident() > 1 << 20


async def test_keep_trimmed_trims_after_growth_only(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    if heap._malloc_trim() is None:
        pytest.skip("this C library has no malloc_trim (not glibc)")
    # What each reading of the process's size says, in MiB: the first is the floor; a trim is
    # followed by a reading of what it left.
    readings = iter([100, 100, 100, 150, 90, 91, 80, 80, 85, 70, 60])
    trims: list[int] = []
    last = [0]

    def resident() -> int:
        last[0] = next(readings)
        return last[0] << 20

    def trim() -> bool:
        trims.append(last[0])
        return True

    monkeypatch.setattr(heap, "resident", resident)
    monkeypatch.setattr(heap, "trim", trim)
    with trio.move_on_after(heap.PERIOD * 7.5):  # seven looks
        await heap.keep_trimmed()
    # No growth at 100, 100; 150 grew: trimmed (to 90); 91 grew by a MiB: trimmed (to 80);
    # 80 is no growth; 85 is: trimmed (to 70); 60 is less: the floor follows it down.
    assert trims == [150, 91, 85]
    assert next(readings, None) is None
