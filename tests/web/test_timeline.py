"""The job timeline: ``build`` turns a job's events into segments and marks, ``render_svg`` draws
them as an inline SVG the page's Content-Security-Policy allows."""

from __future__ import annotations

import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import msgspec
import pytest

from vpool.protocol import api
from vpool.web.timeline import (
    MARK_KINDS,
    MAX_ROWS,
    STATES,
    Mark,
    Row,
    Segment,
    Timeline,
    build,
    mark_kind,
    render_svg,
)

SVG = "{http://www.w3.org/2000/svg}"
T0 = 1000.0


def job(
    state: api.JobState = "running",
    ranks: int = 2,
    created: float = T0,
    finished: float | None = None,
    on_failure: api.FailureMode = "transparent",
    spawned: int = 0,
) -> api.JobInfo:
    return api.JobInfo(
        id=7,
        name="j",
        user="alice",
        state=state,
        ranks=ranks,
        exit_code=None,
        reason="",
        created=created,
        started=None,
        finished=finished,
        on_failure=on_failure,
        spawned=spawned,
    )


def ev(at: float, kind: str, rank: int | None = None, message: str = "") -> api.JobEvent:
    return api.JobEvent(time=T0 + at, kind=kind, message=message or kind, rank=rank)


def rows(tl: Timeline, rank: int) -> list[tuple[str, float, float, int | None]]:
    """(state, start, end, incarnation) of a rank's segments, times from T0."""
    return [
        (s.state, s.start - T0, s.end - T0, s.incarnation) for s in tl.segments if s.rank == rank
    ]


STARTED = [
    ev(0, "queued", message="submitted by alice: 2 ranks"),
    ev(1, "running", message="placed 2 ranks on 1 agent(s), relays relay-0"),
    ev(2, "rank_running", 0),
    ev(2, "rank_running", 1),
]


def test_plain_run() -> None:
    events = [
        *STARTED,
        ev(10, "rank_exited", 0),
        ev(11, "rank_exited", 1),
        ev(11, "succeeded", message="every rank exited with code 0"),
    ]
    tl = build(job("succeeded", finished=T0 + 11), events, now=T0 + 500)
    assert rows(tl, 0) == [
        ("queued", 0, 1, None),
        ("starting", 1, 2, 1),
        ("running", 2, 10, 1),
    ]
    assert rows(tl, 1)[-1] == ("running", 2, 11, 1)
    assert tl.segments[0].label == "submitted by alice: 2 ranks"
    assert (tl.start, tl.end, tl.ranks, tl.live, tl.marks) == (T0, T0 + 11, 2, False, [])


@pytest.mark.parametrize("replaying_first", [False, True])
def test_lost_rank_restarted_and_replaying(replaying_first: bool) -> None:
    # The coordinator says "rank_replaying" at placement when the images cannot be used there
    # (before the rank runs), or at the incarnation's first heartbeat (right after it runs).
    then = (
        [ev(8, "rank_replaying", 1, "starts from the beginning"), ev(9, "rank_running", 1)]
        if replaying_first
        else [ev(9, "rank_running", 1), ev(9, "rank_replaying", 1, "replays 3 frames")]
    )
    events = [
        *STARTED,
        ev(5, "rank_lost", 1, "rank 1 lost: agent a stopped heartbeating"),
        ev(8, "rank_restarted", 1, "rank 1 incarnation 2 on agent b"),
        *then,
        ev(20, "rank_exited", 0),
        ev(21, "rank_exited", 1),
        ev(21, "succeeded"),
    ]
    tl = build(job("succeeded", finished=T0 + 21), events, now=T0 + 21)
    assert rows(tl, 1) == [
        ("queued", 0, 1, None),
        ("starting", 1, 2, 1),
        ("running", 2, 5, 1),
        ("lost", 5, 8, 1),
        ("starting", 8, 9, 2),
        ("replaying", 9, 21, 2),
    ]
    assert rows(tl, 0)[-1] == ("running", 2, 20, 1)
    (lost,) = [s for s in tl.segments if s.state == "lost"]
    assert lost.label == "rank 1 lost: agent a stopped heartbeating"
    later = [s for s in tl.segments if s.rank == 1 and s.start >= lost.end]
    assert later and all(s.state != "lost" for s in later)
    assert [(m.rank, m.time - T0, m.kind) for m in tl.marks] == [(1, 5, "fault")]


def test_a_message_that_did_not_open_shows_its_rank_lost_with_a_warning() -> None:
    why = "rank 1: a message relay r pushed did not open at agent a (...): message 3 ..."
    events = [
        *STARTED,
        ev(5, "integrity_failure", 1, why),
        ev(6, "rank_restarted", 1, "rank 1 incarnation 2 on agent b"),
        ev(7, "rank_running", 1),
    ]
    tl = build(job(), events, now=T0 + 10)
    assert rows(tl, 1)[2:] == [
        ("running", 2, 5, 1),
        ("lost", 5, 6, 1),
        ("starting", 6, 7, 2),
        ("running", 7, 10, 2),
    ]
    assert [s.label for s in tl.segments if s.state == "lost"] == [why]
    assert [(m.rank, m.time - T0, m.kind) for m in tl.marks] == [(1, 5, "warning")]


def test_waiting_for_a_restorer_then_restored_from_a_checkpoint() -> None:
    events = [
        *STARTED,
        ev(3, "checkpoint", 0, "rank 0: checkpoint 1 committed"),
        ev(3, "checkpoint", 1, "rank 1: checkpoint 1 committed"),
        ev(4, "checkpoint_failed", 1, "checkpoint 2 failed"),
        ev(5, "rank_lost", 1),
        ev(5, "rank_waiting_restore", 1, "rank 1 incarnation 2 waits"),
        ev(7, "rank_restarted", 1, "to restore from checkpoint 1"),
        ev(8, "restore_failed", 1, "checkpoint 0 not used"),
        ev(8, "rank_restored", 1, "rank 1 incarnation 2 restored from checkpoint 1"),
        ev(9, "rank_running", 1),
    ]
    tl = build(job(), events, now=T0 + 12)
    assert rows(tl, 1)[2:] == [
        ("running", 2, 5, 1),
        ("waiting", 5, 7, 1),
        ("starting", 7, 9, 2),
        ("restored", 9, 12, 2),
    ]
    restored = [s for s in tl.segments if s.state == "restored"]
    assert restored[0].label == "rank 1 incarnation 2 restored from checkpoint 1"
    assert [(m.rank, m.time - T0, m.kind) for m in tl.marks] == [
        (0, 3, "checkpoint"),
        (1, 3, "checkpoint"),
        (1, 4, "fault"),
        (1, 5, "fault"),
        (1, 8, "fault"),
    ]


def test_restore_reported_after_the_rank_runs() -> None:
    events = [
        *STARTED,
        ev(5, "rank_lost", 1),
        ev(6, "rank_restarted", 1),
        ev(7, "rank_running", 1),
        ev(8, "rank_restored", 1),
    ]
    tl = build(job(), events, now=T0 + 10)
    assert rows(tl, 1)[-2:] == [("running", 7, 8, 2), ("restored", 8, 10, 2)]


def test_suspended_ranks_resume_to_what_they_showed() -> None:
    events = [
        *STARTED,
        ev(4, "rank_suspended", 0, "rank 0 suspended on agent a: the owner is using the machine"),
        ev(6, "rank_resumed", 0, "rank 0 resumed after 2 s"),
        ev(7, "rank_lost", 1),
        ev(8, "rank_restarted", 1),
        ev(8, "rank_replaying", 1),
        ev(8, "rank_suspended", 1, "rank 1 suspended on agent b: on battery"),  # still starting
        ev(9, "rank_resumed", 1),
        ev(10, "rank_running", 1),
        ev(12, "rank_suspended", 1),
        ev(14, "rank_lost", 1, "rank 1 lost: suspended for too long"),
        ev(15, "rank_resumed", 1),  # of the lost incarnation, late: changes nothing
        ev(16, "rank_resumed", 0),  # not suspended: nothing either
    ]
    tl = build(job(), events, now=T0 + 20)
    assert rows(tl, 0)[2:] == [("running", 2, 4, 1), ("suspended", 4, 6, 1), ("running", 6, 20, 1)]
    assert rows(tl, 1)[3:] == [
        ("lost", 7, 8, 1),
        ("suspended", 8, 9, 2),
        ("starting", 9, 10, 2),
        ("replaying", 10, 12, 2),
        ("suspended", 12, 14, 2),
        ("lost", 14, 20, 2),
    ]
    (frozen, *_) = [s for s in tl.segments if s.state == "suspended"]
    assert frozen.label == "rank 0 suspended on agent a: the owner is using the machine"
    assert [s.label for s in tl.segments if s.rank == 0][-1] == "rank_running"  # as before
    assert [m.kind for m in tl.marks] == ["fault", "fault"]  # the losses only


def test_fence_marks_and_a_late_fenced_exit_after_the_end() -> None:
    events = [
        *STARTED,
        ev(5, "rank_lost", 0),
        ev(5, "rank_restarted", 0),
        ev(6, "rank_fenced", 0, "rank 0 incarnation 1 exited with code 143; ignored"),
        ev(7, "rank_running", 0),
        ev(9, "rank_exited", 0),
        ev(9, "rank_exited", 1),
        ev(9, "succeeded"),
        ev(12, "rank_fenced", 1, "a late exit"),
    ]
    tl = build(job("succeeded", finished=T0 + 9), events, now=T0 + 50)
    fences = [(m.rank, m.time - T0, m.label) for m in tl.marks if m.kind == "fence"]
    assert fences == [
        (0, 6, "rank 0 incarnation 1 exited with code 143; ignored"),
        (1, 12, "a late exit"),
    ]
    # The axis reaches the late mark; no row goes on after the job's end.
    assert tl.end == T0 + 12
    assert max(s.end for s in tl.segments) == T0 + 9


def test_live_job_ends_at_now() -> None:
    events = [*STARTED, ev(5, "rank_exited", 0), ev(30, "rank_lost", 1)]
    tl = build(job("running"), events, now=T0 + 30)
    assert tl.live and tl.end == T0 + 30
    assert rows(tl, 0)[-1] == ("running", 2, 5, 1)  # exited: the row ends
    # The current state shows from its first instant.
    assert rows(tl, 1)[-2:] == [("running", 2, 30, 1), ("lost", 30, 30, 1)]
    queued = build(job("queued"), [ev(0, "queued")], now=T0 + 4)
    assert rows(queued, 1) == [("queued", 0, 4, None)]
    assert queued.live and queued.end == T0 + 4


def test_finished_job_ends_at_finished_with_job_wide_marks() -> None:
    events = [
        *STARTED,
        ev(4, "relay_down", message="relay relay-0 stopped heartbeating"),
        ev(6, "relay_up", message="relay relay-0 is back"),
        ev(8, "job_failed", 1, "program is not deterministic"),
        ev(8, "failed", message="program is not deterministic"),
    ]
    tl = build(job("failed", finished=T0 + 8), events, now=T0 + 100)
    assert not tl.live and tl.end == T0 + 8
    assert all(s.end <= T0 + 8 for s in tl.segments)
    assert rows(tl, 0)[-1] == ("running", 2, 8, 1)
    assert [(m.rank, m.kind) for m in tl.marks] == [
        (None, "fault"),
        (None, "recovery"),
        (1, "fault"),
        (None, "fault"),
    ]


def test_cancelled_while_queued() -> None:
    tl = build(job("cancelled", finished=T0 + 3), [ev(0, "queued"), ev(3, "cancelled")], now=T0 + 9)
    assert rows(tl, 0) == rows(tl, 1) == [("queued", 0, 3, None)]


@pytest.mark.parametrize("mode", [m for m in api.FAILURE_MODES if m in api.REPORTING_MODES])
def test_a_rank_declared_failed_shows_failed_until_the_job_ends(mode: api.FailureMode) -> None:
    """In a job whose mode reports failures ("ulfm", "blank", "shrink", "rebuild") a lost rank
    is declared failed (``rank_failed``) and never replaced: its row shows ``failed`` (with a
    fault mark) until the job's end, whatever comes after from the failed incarnation. In other
    jobs ``rank_failed`` fails the job at once: nothing is drawn."""
    declared = f"rank 1 lost: declared failed; the other ranks are told (on-failure {mode})"
    events = [
        *STARTED,
        ev(5, "rank_failed", 1, declared),
        ev(6, "rank_suspended", 1),  # odd data from the failed incarnation: ignored
        ev(7, "rank_exited", 1),
        ev(9, "rank_exited", 0),
        ev(9, "succeeded"),
    ]
    live = build(job(on_failure=mode), events[:5], now=T0 + 8)
    assert rows(live, 1)[-2:] == [("running", 2, 5, 1), ("failed", 5, 8, 1)]
    assert live.segments[-1].label == declared
    _check(live)
    done = build(job("succeeded", finished=T0 + 9, on_failure=mode), events, now=T0 + 30)
    assert rows(done, 1)[-2:] == [("running", 2, 5, 1), ("failed", 5, 9, 1)]
    assert rows(done, 0)[-1] == ("running", 2, 9, 1)
    assert [(m.rank, m.time - T0, m.kind) for m in done.marks] == [(1, 5, "fault")]
    _check(done)
    svg = str(render_svg(done))
    assert 'class="seg seg-failed" data-rank="1" data-state="failed" data-incarnation="1"' in svg
    # A failing exit (any mode) fails the job in the same instant: no failed segment.
    for each in api.FAILURE_MODES:
        exit_failed = [
            *STARTED,
            ev(5, "rank_failed", 1, "rank 1 exited with code 3"),
            ev(5, "failed"),
        ]
        tl = build(job("failed", finished=T0 + 5, on_failure=each), exit_failed, now=T0 + 9)
        assert rows(tl, 1)[-1] == ("running", 2, 5, 1), each
        assert "failed" not in {s.state for s in tl.segments}


FUTURES = "rank 0 spawned ranks 2 to 3: python -m mpi4py.futures.server"


def test_spawned_processes_get_rows_from_their_spawn() -> None:
    """Rank 0 spawns ranks 2 and 3 (mpi4py.futures' workers), rank 2 spawns rank 4 in turn: each
    gets a row after the first ranks, labelled by its spawner, starting at its spawn (queued
    until it is placed); from there its row is drawn as any rank's."""
    events = [
        *STARTED,
        ev(4, "spawn", 0, FUTURES),
        ev(5, "rank_spawned", 2, "spawned rank 2 incarnation 1 on agent agent-1"),
        ev(5, "rank_spawned", 3, "spawned rank 3 incarnation 1 on agent agent-2"),
        ev(6, "rank_running", 2),
        ev(7, "rank_running", 3),
        ev(8, "spawn", 2, "rank 2 spawned ranks 4 to 4: python worker.py"),
        ev(9, "rank_lost", 3, "rank 3 lost: agent agent-2 stopped heartbeating"),
        ev(10, "rank_restarted", 3, "rank 3 incarnation 2 on agent agent-1"),
        ev(11, "rank_spawned", 4, "spawned rank 4 incarnation 1 on agent agent-1"),
        ev(12, "rank_running", 3),
        ev(12, "rank_replaying", 3),
        ev(12, "rank_running", 4),
        ev(15, "rank_exited", 4),
        ev(16, "rank_exited", 2),
        ev(16, "rank_exited", 3),
        ev(17, "rank_exited", 0),
        ev(17, "rank_exited", 1),
        ev(17, "succeeded"),
    ]
    tl = build(job("succeeded", finished=T0 + 17, spawned=3), events, now=T0 + 30)
    assert tl.ranks == 5 and tl.hidden == 0
    assert tl.rows == [
        Row(rank=0, label="rank 0", start=T0),
        Row(rank=1, label="rank 1", start=T0),
        Row(rank=2, label="rank 2 (spawned by rank 0)", start=T0 + 4, spawned=True, spawned_by=0),
        Row(rank=3, label="rank 3 (spawned by rank 0)", start=T0 + 4, spawned=True, spawned_by=0),
        Row(rank=4, label="rank 4 (spawned by rank 2)", start=T0 + 8, spawned=True, spawned_by=2),
    ]
    assert rows(tl, 0) == [("queued", 0, 1, None), ("starting", 1, 2, 1), ("running", 2, 17, 1)]
    assert rows(tl, 2) == [("queued", 4, 5, None), ("starting", 5, 6, 1), ("running", 6, 16, 1)]
    assert rows(tl, 3) == [
        ("queued", 4, 5, None),
        ("starting", 5, 7, 1),
        ("running", 7, 9, 1),
        ("lost", 9, 10, 1),
        ("starting", 10, 12, 2),
        ("replaying", 12, 16, 2),
    ]
    assert rows(tl, 4) == [("queued", 8, 11, None), ("starting", 11, 12, 1), ("running", 12, 15, 1)]
    queued = [s.label for s in tl.segments if s.state == "queued"]
    assert queued == ["submitted by alice: 2 ranks"] * 2 + [FUTURES] * 2 + [
        "rank 2 spawned ranks 4 to 4: python worker.py"
    ]
    assert [(m.rank, m.time - T0, m.kind) for m in tl.marks] == [(3, 9, "fault")]
    _check(tl)
    assert msgspec.json.decode(msgspec.json.encode(tl), type=Timeline) == tl

    _, root = _svg(tl)
    labels = [(t.text, _classes(t)) for t in root.iter(f"{SVG}text") if "row-label" in _classes(t)]
    assert labels == [
        ("job", ["row-label"]),
        ("rank 0", ["row-label"]),
        ("rank 1", ["row-label"]),
        ("rank 2 (spawned by rank 0)", ["row-label", "spawned"]),
        ("rank 3 (spawned by rank 0)", ["row-label", "spawned"]),
        ("rank 4 (spawned by rank 2)", ["row-label", "spawned"]),
    ]
    by = [t.get("data-spawned-by") for t in root.iter(f"{SVG}text") if "spawned" in _classes(t)]
    assert by == ["0", "0", "2"]
    assert "5 ranks (3 spawned)" in root.get("aria-label", "")
    # The label column is wide enough for the longest label: the plot starts after it.
    rects = [r for r in root.iter(f"{SVG}rect") if "row" in _classes(r)]
    assert len(rects) == 5 and {float(r.get("x", "0")) for r in rects} == {
        math.ceil(len("rank 2 (spawned by rank 0)") * 6.5) + 6
    }
    # The spawned rows' first segments start at the spawn, right of the first ranks' queued.
    first = {
        r.get("data-rank"): float(r.get("x", "0"))
        for r in reversed(list(root.iter()))
        if "seg" in _classes(r)
    }
    assert first["0"] < first["2"] == first["3"] < first["4"]

    # While the job runs, a spawned process not placed yet is queued until now, and one whose
    # spawn is recorded but not yet counted in the job's info has its row all the same.
    live = build(job(spawned=0), events[:7], now=T0 + 5.5)
    assert live.ranks == 4
    assert rows(live, 3) == [("queued", 4, 5, None), ("starting", 5, 5.5, 1)]
    _check(live)


def test_a_spawned_process_without_its_spawn_event() -> None:
    """The job's info counts spawned processes the events do not cover (odd data): their rows
    are drawn from their first placement, or empty, labelled without a spawner."""
    events = [
        *STARTED,
        ev(6, "rank_running", 2),
        ev(7, "rank_spawned", 2),
        ev(8, "rank_running", 2),
    ]
    tl = build(job(spawned=2), events, now=T0 + 9)
    assert [(r.label, r.start, r.spawned_by) for r in tl.rows[2:]] == [
        ("rank 2 (spawned)", T0 + 7, None),
        ("rank 3 (spawned)", None, None),
    ]
    assert rows(tl, 2) == [("starting", 7, 8, 1), ("running", 8, 9, 1)]
    assert rows(tl, 3) == []
    _check(tl)


def test_a_rebuild_jobs_failed_rank_and_the_process_spawned_after_it() -> None:
    """In "rebuild" rank 1 is declared failed; the survivors spawn a new process (rank 3, from
    the lowest survivor): the failed row shows failed until the end, the new one has a row of
    its own from its spawn. It is labelled as spawned by rank 0: nothing in the data says a
    spawn replaces failed ranks (an ordinary spawn after a failure looks the same)."""
    declared = "rank 1 lost: declared failed; the other ranks are told (on-failure rebuild)"
    spawn = "rank 0 spawned ranks 3 to 3: /usr/bin/python3 app.py --steps 10"
    events = [
        ev(0, "queued", message="submitted by alice: 3 ranks"),
        ev(1, "running"),
        *[ev(2, "rank_running", r) for r in range(3)],
        ev(5, "rank_failed", 1, declared),
        ev(6, "spawn", 0, spawn),
        ev(7, "rank_spawned", 3),
        ev(8, "rank_running", 3),
        ev(11, "rank_failed", 3, "rank 3 lost: declared failed"),  # failed in turn
        ev(12, "spawn_refused", 0, "rank 0: the job has spawned 1 processes, the most"),
        ev(14, "rank_exited", 0),
        ev(14, "rank_exited", 2),
        ev(14, "succeeded"),
    ]
    j = job("succeeded", ranks=3, finished=T0 + 14, on_failure="rebuild", spawned=1)
    tl = build(j, events, now=T0 + 20)
    assert [r.label for r in tl.rows] == [
        "rank 0",
        "rank 1",
        "rank 2",
        "rank 3 (spawned by rank 0)",
    ]
    assert tl.rows[3].start == T0 + 6 and not any("place" in r.label for r in tl.rows)
    assert rows(tl, 1)[-2:] == [("running", 2, 5, 1), ("failed", 5, 14, 1)]
    assert rows(tl, 3) == [
        ("queued", 6, 7, None),
        ("starting", 7, 8, 1),
        ("running", 8, 11, 1),
        ("failed", 11, 14, 1),
    ]
    assert rows(tl, 0)[-1] == rows(tl, 2)[-1] == ("running", 2, 14, 1)
    assert [(m.rank, m.time - T0, m.kind) for m in tl.marks] == [(1, 5, "fault"), (3, 11, "fault")]
    _check(tl)
    svg = str(render_svg(tl))
    assert 'data-spawned-by="0"' in svg and ">rank 3 (spawned by rank 0)</text>" in svg
    assert 'class="seg seg-failed" data-rank="3"' in svg


def test_a_job_spawning_1024_processes_draws_the_first_rows_and_a_summary() -> None:
    events = [
        ev(0, "queued"),
        ev(1, "running"),
        *[ev(2, "rank_running", r) for r in range(4)],
        ev(3, "spawn", 0, "rank 0 spawned ranks 4 to 1023: python -m mpi4py.futures.server"),
        ev(4, "spawn", 0, "rank 0 spawned ranks 1024 to 1027: python -m mpi4py.futures.server"),
    ]
    for r in range(4, 1028):
        events += [ev(5, "rank_spawned", r), ev(6, "rank_running", r)]
    events += [ev(7, "rank_lost", 1000), ev(7, "checkpoint", 300)]  # of processes not drawn
    tl = build(job(ranks=4, spawned=1024), events, now=T0 + 10)
    assert (tl.ranks, tl.hidden, len(tl.rows)) == (MAX_ROWS, 1028 - MAX_ROWS, MAX_ROWS)
    assert tl.rows[-1] == Row(
        rank=255, label="rank 255 (spawned by rank 0)", start=T0 + 3, spawned=True, spawned_by=0
    )
    assert {s.rank for s in tl.segments} == set(range(MAX_ROWS)) and tl.marks == []
    assert rows(tl, 255) == [("queued", 3, 5, None), ("starting", 5, 6, 1), ("running", 6, 10, 1)]
    _check(tl)
    text, root = _svg(tl, row_height=12)
    labels = [t.text for t in root.iter(f"{SVG}text") if "row-label" in _classes(t)]
    assert len(labels) == 1 + MAX_ROWS and labels[-1] == "rank 255 (spawned by rank 0)"
    (more,) = [t for t in root.iter(f"{SVG}text") if "more" in _classes(t)]
    assert more.text == "and 772 more spawned processes"
    # The summary is a row of its own, between the last rank and the axis.
    (axis,) = [el for el in root.iter(f"{SVG}line") if "axis" in _classes(el)]
    last_row = max(float(r.get("y", "0")) for r in root.iter(f"{SVG}rect") if "row" in _classes(r))
    assert last_row + 12 < float(more.get("y", "0")) < float(axis.get("y1", "0"))
    assert float(root.get("height", "0")) < (MAX_ROWS + 2) * 12 + 120
    assert "256 ranks (252 spawned; 772 more spawned processes not drawn) over" in root.get(
        "aria-label", ""
    )
    assert 'data-rank="256"' not in text
    # One more than fits: "process"; first ranks are always drawn, spawned ones after them.
    one = build(job(ranks=4, spawned=MAX_ROWS - 3), events[:6], now=T0 + 10)
    assert (one.ranks, one.hidden) == (MAX_ROWS, 1)
    _, root = _svg(one)
    assert [t.text for t in root.iter(f"{SVG}text") if "more" in _classes(t)] == [
        "and 1 more spawned process"
    ]
    wide = build(job(ranks=300, spawned=5), [ev(0, "queued")], now=T0 + 1)
    assert (wide.ranks, wide.hidden) == (300, 5) and not any(r.spawned for r in wide.rows)
    _check(wide)


def _check(tl: Timeline) -> None:
    assert tl.start <= tl.end
    for s in tl.segments:
        assert 0 <= s.rank < tl.ranks and s.state in STATES
        assert tl.start <= s.start <= s.end <= tl.end
    for m in tl.marks:
        assert m.kind in MARK_KINDS and (m.rank is None or 0 <= m.rank < tl.ranks)
    ET.fromstring(str(render_svg(tl)))


def test_validation_by_replay_reopens_the_row_of_an_exited_rank() -> None:
    """Rank 0 exits; its re-execution is lost, placed again, disagrees (a warning), a third
    execution corrects it. Its replay of the log is not a ``replaying`` segment: the row says
    what the incarnation is for."""
    events = [
        *STARTED,
        ev(10, "rank_exited", 0),
        ev(11, "rank_exited", 1),
        ev(11, "validating", message="every rank exited with code 0; validating: rank(s) 0"),
        ev(12, "rank_validating", 0, "rank 0 incarnation 2 re-executed to validate it"),
        ev(13, "rank_running", 0),
        ev(13, "rank_replaying", 0),
        ev(15, "rank_lost", 0),
        ev(16, "rank_validating", 0, "rank 0 incarnation 3 re-executed to validate it"),
        ev(17, "rank_running", 0),
        ev(20, "rank_reexecuted", 0),
        ev(20, "validation_mismatch", 0),
        ev(21, "rank_validating", 0, "rank 0 incarnation 4 re-executed a third time"),
        ev(22, "rank_running", 0),
        ev(23, "rank_replaying", 0),
        ev(25, "rank_reexecuted", 0),
        ev(25, "validation_corrected", 0),
        ev(25, "agent_distrusted", 0),
        ev(26, "succeeded"),
    ]
    tl = build(job("succeeded", finished=T0 + 26), events, now=T0 + 30)
    assert rows(tl, 0)[2:] == [
        ("running", 2, 10, 1),
        ("starting", 12, 13, 2),
        ("validating", 13, 15, 2),
        ("lost", 15, 16, 2),
        ("starting", 16, 17, 3),
        ("validating", 17, 20, 3),
        ("starting", 21, 22, 4),
        ("validating", 22, 25, 4),
    ]
    validating = [s for s in tl.segments if s.state == "validating"]
    assert validating[-1].label == "rank 0 incarnation 4 re-executed a third time"
    assert rows(tl, 1)[-1] == ("running", 2, 11, 1)  # not sampled: its row stays ended
    assert [(m.rank, m.time - T0, m.kind) for m in tl.marks] == [
        (0, 15, "fault"),
        (0, 20, "warning"),
        (0, 25, "corrected"),
        (0, 25, "warning"),
    ]
    # Still validating: the re-execution's segment runs until now.
    live = build(job(), events[:9], now=T0 + 14)
    assert rows(live, 0)[-1] == ("validating", 13, 14, 2)
    _check(live)
    _, root = _svg(tl)
    shapes = {_classes(el)[1]: el.tag for el in root.iter() if "mark" in _classes(el)}
    assert shapes == {
        "mark-fault": f"{SVG}polygon",
        "mark-warning": f"{SVG}polygon",
        "mark-corrected": f"{SVG}rect",
    }


def test_mark_kinds_of_event_kinds() -> None:
    assert mark_kind("validation_mismatch") == mark_kind("agent_distrusted") == "warning"
    assert mark_kind("validation_corrected") == "corrected"
    assert mark_kind("rank_lost") == "fault" and mark_kind("checkpoint") == "checkpoint"
    for kind in ("validating", "rank_validating", "rank_reexecuted", "rank_running", "x"):
        assert mark_kind(kind) is None, kind
    css = (Path(__file__).parents[2] / "web" / "static" / "timeline.css").read_text()
    for state in STATES:
        assert f".timeline .seg-{state} " in css, state
    assert mark_kind("spawn") is None and mark_kind("rank_spawned") is None
    for kind in MARK_KINDS:
        assert f".timeline .mark-{kind} " in css and f".mark-rule-{kind} " in css, kind


def test_garbage_events_do_not_raise() -> None:
    garbage = [
        ev(3, "rank_running", 999),
        ev(3, "rank_lost", -1),
        ev(3, "rank_lost", None),
        ev(3, "checkpoint", 5),
        ev(4, "no_such_kind", 0),
        ev(4, "rank_running", 0),  # before the job runs
        api.JobEvent(time=math.nan, kind="rank_lost", message="", rank=0),
        api.JobEvent(time=math.inf, kind="rank_exited", message="", rank=1),
        ev(-50, "rank_restarted", 1),  # before the job was created
        ev(2, "rank_exited", 0),
        ev(1, "rank_exited", 0),  # twice, out of order
        ev(6, "running"),  # twice
        ev(7, "rank_replaying", 1),
        ev(7, "rank_restored", 1),
        ev(7, "rank_validating", 0),  # a re-execution of a rank that never exited
        ev(7, "rank_reexecuted", 5),
        ev(7, "validation_mismatch", None),
        ev(8, "succeeded"),
        ev(8, "rank_validating", 1),  # after the end
        ev(9, "rank_running", 1),  # after the end
        ev(9, "failed"),
        ev(5, "spawn", 0, "rank 0 spawned ranks 2 to 2: python x.py"),
        ev(5, "spawn", None, "rank 1 spawned ranks 3 to 1: upside down"),
        ev(5, "spawn", 0, "rank 0 spawned ranks 0 to 1: the job's first ranks"),
        ev(5, "spawn", 0, f"rank 0 spawned ranks {'9' * 5000} to 3: too many digits"),
        ev(5, "spawn", 0, "no such message"),
        ev(6, "rank_spawned", 2),
        ev(6, "rank_spawned", 0),  # not a spawned process
    ]
    for j in (
        job(),
        job("succeeded", finished=T0 + 8),
        job("failed", finished=None),
        job(ranks=0),
        job(ranks=-3),
        job(created=math.nan),
        job("cancelled", finished=math.inf),
        job(spawned=-4),
        job(ranks=0, spawned=3),
    ):
        for events in (garbage, list(reversed(garbage)), []):
            _check(build(j, events, now=T0 + 10))
    tl = build(job(), garbage, now=T0 + 10)
    assert tl.start == T0 - 50
    assert all(m.rank in (None, 0, 1) for m in tl.marks)
    assert [r.label for r in tl.rows] == ["rank 0", "rank 1", "rank 2 (spawned by rank 0)"]
    assert rows(tl, 2) == [("queued", 5, 6, None), ("starting", 6, 8, 1)]


def test_events_out_of_order_are_taken_by_time() -> None:
    events = [*STARTED, ev(5, "rank_lost", 1), ev(7, "rank_restarted", 1), ev(8, "rank_running", 1)]
    shuffled = [events[i] for i in (6, 2, 0, 5, 4, 3, 1)]
    assert build(job(), shuffled, now=T0 + 9) == build(job(), events, now=T0 + 9)


def test_timeline_is_json() -> None:
    tl = build(job(), [*STARTED, ev(3, "checkpoint", 0)], now=T0 + 5)
    assert msgspec.json.decode(msgspec.json.encode(tl), type=Timeline) == tl


# -- render_svg ---------------------------------------------------------------------------------


def _classes(el: ET.Element) -> list[str]:
    return el.get("class", "").split()


def _svg(tl: Timeline, **kw: Any) -> tuple[str, ET.Element]:
    text = str(render_svg(tl, **kw))
    return text, ET.fromstring(text)


def test_svg_rows_segments_marks_and_legend() -> None:
    events = [
        *STARTED,
        ev(3, "checkpoint", 0),
        ev(4, "relay_down"),
        ev(5, "rank_lost", 1),
        ev(6, "rank_restarted", 1),
        ev(6, "rank_fenced", 1),
        ev(7, "rank_running", 1),
        ev(7, "rank_replaying", 1),
    ]
    tl = build(job(ranks=3), events, now=T0 + 10)
    text, root = _svg(tl)
    assert root.tag == f"{SVG}svg"
    assert _classes(root) == ["timeline"]
    assert root.get("role") == "img" and "3 ranks" in root.get("aria-label", "")
    assert root.get("data-live") == "true"
    labels = [t.text for t in root.iter(f"{SVG}text") if "row-label" in _classes(t)]
    assert labels == ["job", "rank 0", "rank 1", "rank 2"]
    segs = [r for r in root.iter(f"{SVG}rect") if "seg" in _classes(r)]
    assert len(segs) == len(tl.segments)
    for rect, seg in zip(segs, tl.segments, strict=True):
        assert _classes(rect) == ["seg", f"seg-{seg.state}"]
        assert rect.get("data-rank") == str(seg.rank) and rect.get("data-state") == seg.state
        title = rect.find(f"{SVG}title")
        assert title is not None and title.text and seg.state in title.text
        assert float(rect.get("width", "0")) >= 1
    assert {r.get("data-state") for r in segs} == {
        "queued",
        "starting",
        "running",
        "lost",
        "replaying",
    }
    marks = [(el.get("data-rank"), _classes(el)) for el in root.iter() if "mark" in _classes(el)]
    assert marks == [
        ("0", ["mark", "mark-checkpoint"]),
        ("job", ["mark", "mark-fault"]),
        ("1", ["mark", "mark-fault"]),
        ("1", ["mark", "mark-fence"]),
    ]
    legend = [t.text for t in root.iter(f"{SVG}text") if "legend-label" in _classes(t)]
    assert legend == [*STATES, *MARK_KINDS]
    ticks = [t.text for t in root.iter(f"{SVG}text") if "tick-label" in _classes(t)]
    assert ticks[0] == "0 s" and len(ticks) >= 3 and all(t and t.endswith(" s") for t in ticks)
    assert 'class="now"' in text


def test_svg_escapes_text_and_needs_no_styles_or_outside_urls() -> None:
    hostile = "<script>alert(\"x\")</script> & 'quotes'"
    events = [
        ev(0, "queued", message=hostile),
        ev(1, "running"),
        ev(2, "rank_lost", 0, hostile),
        ev(3, "relay_down", message=hostile),
    ]
    tl = build(job(ranks=1), events, now=T0 + 4)
    text, root = _svg(tl)
    assert "<script" not in text and "&lt;script&gt;" in text
    assert not [el for el in root.iter() if el.tag.endswith("script") or el.tag.endswith("style")]
    titles = [t.text for t in root.iter(f"{SVG}title")]
    # The queued and lost segments, the loss and the relay's marks.
    assert sum(hostile in (t or "") for t in titles) == 4
    assert "style=" not in text
    assert not [el for el in root.iter() if "style" in el.attrib]
    assert re.findall(r"https?://[^\"'\s<>]*", text) == ["http://www.w3.org/2000/svg"]
    assert not [el for el in root.iter() if any(k.endswith("href") for k in el.attrib)]


def test_svg_of_64_ranks_and_of_odd_timelines() -> None:
    events = [ev(0, "queued"), ev(1, "running")]
    for r in range(64):
        events += [ev(2 + r / 10, "rank_running", r), ev(60, "checkpoint", r)]
        events += [ev(70 + r, "rank_lost", r), ev(71 + r, "rank_restarted", r)]
        events += [ev(72 + r, "rank_running", r), ev(72 + r, "rank_replaying", r)]
    tl = build(job(ranks=64), events, now=T0 + 200)
    _, root = _svg(tl, row_height=12)
    labels = [t.text for t in root.iter(f"{SVG}text") if "row-label" in _classes(t)]
    assert labels == ["job"] + [f"rank {r}" for r in range(64)]
    assert len([r for r in root.iter(f"{SVG}rect") if "seg" in _classes(r)]) == 64 * 6
    assert float(root.get("height", "0")) > 64 * 12
    # Hand-made timelines: nothing to draw, no duration, things outside the rows.
    odd = [
        Timeline(start=0, end=0, ranks=0, segments=[], marks=[], live=False),
        Timeline(
            start=5,
            end=5,
            ranks=1,
            segments=[
                Segment(rank=0, start=5, end=5, state="running", incarnation=1, label=""),
                Segment(rank=3, start=5, end=5, state="lost", incarnation=None, label=""),
            ],
            marks=[
                Mark(rank=9, time=5, kind="fault", label=""),
                Mark(rank=0, time=5, kind="other", label="<b>"),
            ],
            live=True,
        ),
    ]
    for tl in odd:
        _, root = _svg(tl, width=10, row_height=1)
        assert _classes(root) == ["timeline"]


# -- from the real store ------------------------------------------------------------------------


async def test_timeline_from_the_store_shows_a_lost_and_replaced_rank(tmp_path: Path) -> None:
    import coord_helpers as helpers  # loaded by this folder's conftest

    clock = helpers.FakeClock()
    async with helpers.open_pool(tmp_path, clock) as pool:
        await pool.register_relay("relay-0")
        info = await pool.submit(2)
        clock.advance(1)
        agent = await pool.enroll("agent-1", slots=2)  # the job is placed
        leases = await pool.lease(agent)
        clock.advance(1)
        await pool.heartbeat(agent, leases, free=0)
        clock.advance(5)
        killed = api.RankExit(job=info.id, rank=1, incarnation=1, code=-9, lost=True)
        r = await pool.post("/api/v1/agents/exit", killed, agent.headers)
        assert r.status_code == 200, r.text  # no free slot: the replacement waits
        clock.advance(3)
        await pool.heartbeat(agent, leases[:1], free=1)  # a slot: the replacement is placed
        (fresh,) = await pool.lease(agent, free=1)
        assert (fresh.rank, fresh.incarnation) == (1, 2)
        clock.advance(1)
        hb = api.AgentHeartbeat(
            ranks=[
                api.RankState(job=info.id, rank=0, incarnation=1, state="running"),
                api.RankState(job=info.id, rank=1, incarnation=2, state="running", replay_dets=3),
            ],
            free_slots=0,
            isolation=helpers.SANDBOX,
        )
        r = await pool.post("/api/v1/agents/heartbeat", hb, agent.headers)
        assert r.status_code == 200, r.text
        clock.advance(2)
        await pool.exit(agent, leases[0], 0)
        await pool.exit(agent, fresh, 0)
        detail = pool.core.store.job_detail(info.id)
    assert detail is not None and detail.job.state == "succeeded"
    t0 = detail.job.created
    tl = build(detail.job, detail.events, now=clock())
    got = [(s.state, s.start - t0, s.end - t0, s.incarnation) for s in tl.segments if s.rank == 1]
    assert got == [
        ("queued", 0, 1, None),
        ("starting", 1, 2, 1),
        ("running", 2, 7, 1),
        ("lost", 7, 10, 1),
        ("starting", 10, 11, 2),
        ("replaying", 11, 13, 2),
    ]
    (lost,) = [s for s in tl.segments if s.state == "lost"]
    assert any(s.rank == 1 and s.start >= lost.end and s.state != "lost" for s in tl.segments)
    assert [(m.rank, m.kind) for m in tl.marks] == [(1, "fault")]
    assert not tl.live and tl.end == detail.job.finished
    ET.fromstring(str(render_svg(tl)))


async def test_timeline_from_the_store_shows_a_suspended_rank(tmp_path: Path) -> None:
    import coord_helpers as helpers  # loaded by this folder's conftest

    clock = helpers.FakeClock()
    async with helpers.open_pool(tmp_path, clock) as pool:
        await pool.register_relay("relay-0")
        info = await pool.submit(1)
        agent = await pool.enroll("agent-1", slots=1)
        leases = await pool.lease(agent)
        clock.advance(1)
        await pool.heartbeat(agent, leases, free=0)
        clock.advance(2)
        frozen = api.AgentHeartbeat(
            ranks=[api.RankState(job=info.id, rank=0, incarnation=1, state="suspended")],
            free_slots=0,
            isolation=helpers.SANDBOX,
            activity="suspended",
            activity_reason="the owner is using the machine",
        )
        r = await pool.post("/api/v1/agents/heartbeat", frozen, agent.headers)
        assert r.status_code == 200, r.text
        clock.advance(4)
        await pool.heartbeat(agent, leases, free=0)
        clock.advance(1)
        detail = pool.core.store.job_detail(info.id)
    assert detail is not None
    t0 = detail.job.created
    tl = build(detail.job, detail.events, now=clock())
    got = [(s.state, s.start - t0, s.end - t0) for s in tl.segments if s.rank == 0]
    assert got[-3:] == [("running", 1, 3), ("suspended", 3, 7), ("running", 7, 8)]
    labels = [s.label for s in tl.segments if s.state == "suspended"]
    assert labels == ["rank 0 suspended on agent agent-1: the owner is using the machine"]


async def test_timeline_from_the_store_shows_a_rebuild_jobs_spawned_process(
    tmp_path: Path,
) -> None:
    """The coordinator's own events (``spawn``'s message, ``rank_spawned``) make the row."""
    import coord_helpers as helpers  # loaded by this folder's conftest

    clock = helpers.FakeClock()
    async with helpers.open_pool(tmp_path, clock) as pool:
        await pool.register_relay("relay-0")
        info = await pool.submit(3, on_failure="rebuild")
        agent = await pool.enroll("agent-1", slots=3)
        leases = await pool.lease(agent)
        clock.advance(1)
        await pool.heartbeat(agent, leases)
        clock.advance(2)
        lost = leases[1]
        ex = api.RankExit(job=info.id, rank=lost.rank, incarnation=1, code=-9, lost=True)
        assert (await pool.post("/api/v1/agents/exit", ex, agent.headers)).status_code == 200
        told = (await pool.relay_heartbeat("relay-0")).fence
        await pool.relay_heartbeat("relay-0", fenced=told)
        clock.advance(1)
        survivors = [leases[0], leases[2]]
        await pool.heartbeat(agent, survivors)
        ask = api.SpawnAsk(
            job=info.id,
            rank=0,
            incarnation=1,
            seq=1,
            command=["/usr/bin/python3", "app.py"],
            maxprocs=1,
            least=1,
            parent=[0, 2],
            ctx=8,
        )
        r = await pool.post("/api/v1/agents/spawn", ask, agent.headers)
        assert r.status_code == 200, r.text
        clock.advance(1)
        (new,) = await pool.lease(agent)
        assert new.rank == 3
        clock.advance(1)
        await pool.heartbeat(agent, [*survivors, new])
        clock.advance(2)
        for lease in [new, *survivors]:
            assert (await pool.exit(agent, lease, 0)).status_code == 200
        detail = pool.core.store.job_detail(info.id)
    assert detail is not None and detail.job.state == "succeeded"
    assert [r.rank for r in detail.ranks] == [0, 1, 2, 3]
    t0 = detail.job.created
    tl = build(detail.job, detail.events, now=clock())
    assert [r.rank for r in tl.rows] == [r.rank for r in detail.ranks]
    assert tl.rows[3].label == "rank 3 (spawned by rank 0)" and tl.rows[3].start == t0 + 4
    got = [(s.state, s.start - t0, s.end - t0) for s in tl.segments if s.rank == 3]
    # Placed in the instant of its spawn (a slot was free): no queued segment.
    assert got == [("starting", 4, 6), ("running", 6, 8)]
    assert [(s.state, s.start - t0) for s in tl.segments if s.rank == 1][-1] == ("failed", 3)
    ET.fromstring(str(render_svg(tl)))
