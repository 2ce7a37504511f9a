"""The job timeline of the portal's job page: one row per rank over time, segments coloured by
state, marks for checkpoints, faults and fencing.

Rows (``Timeline.rows``): the job's first ranks (``JobInfo.ranks``), then the processes its ranks
spawned (``MPI.Comm.Spawn``, mpi4py.futures; FT-MPI's "rebuild" replacements are spawns too),
which are more ranks of the job numbered after the first ones (``JobInfo.spawned`` of them), in
rank order: the rows of the ranks ``api.JobDetail.ranks`` lists. A spawned process's row is
labelled with the rank that spawned it, from the job event ``spawn`` that covers it ("rank 0
spawned ranks 4 to 5: ...", written by the coordinator's ``sqlite_spawn``), and starts at that
event: ``queued`` until it is placed (``rank_spawned``), then as any rank. A "rebuild" job's
new process in a failed rank's place is labelled like any spawn: neither the event nor the
spawn request says whether a spawn replaces failed ranks (the program may spawn after a failure
itself), so the row does not guess. At most ``MAX_ROWS`` rows are drawn, the first ranks
always; the spawned processes past them are counted in ``Timeline.hidden`` (their events make
no row and no mark).

``build`` turns a job's event list (``api.JobDetail.events``, written by the coordinator's
store) into a ``Timeline``: plain msgspec Structs, so an API route can return the same model as
JSON. ``render_svg`` draws it as an inline ``<svg>`` with no scripts and no style attributes:
the page's Content-Security-Policy allows neither, so every colour comes from a class in
``static/timeline.css``.

Segment states (``STATES``) and the events that start them:

- ``queued``: from the job's creation until the job is placed (job event ``running``); for a
  spawned process, from its ``spawn`` until it is placed (``rank_spawned``);
- ``starting``: an incarnation is leased to an agent (``running``, ``rank_restarted``,
  ``rank_spawned``) and has not said it runs yet;
- ``running``: the first incarnation runs (``rank_running``);
- ``replaying``: a replacement that re-runs from the beginning and replays its log
  (``rank_replaying``). No event says when it caught up, so the whole run of that incarnation
  (from ``rank_running``, or from ``rank_replaying`` if that comes later) is ``replaying``: it
  is a replacement, which is what the row should show;
- ``restored``: a replacement restored from a checkpoint image (``rank_restored``): its whole
  run, or from the report on if the incarnation said it runs before it reported the restore;
- ``suspended``: the incarnation is frozen on its volunteer's machine, which is in use
  (``rank_suspended``), until it resumes (``rank_resumed``: the row goes back to what it
  showed before), is lost or ends;
- ``lost``: from ``rank_lost`` (or ``integrity_failure``: a message for it did not open at
  its agent, and it is restarted elsewhere) until the replacement incarnation is placed
  (``rank_restarted``), or until the job ends;
- ``failed``: in a job whose failure mode reports failures (``api.REPORTING_MODES``: "ulfm",
  "blank", "shrink", "rebuild"), from ``rank_failed`` (the rank is declared failed: never
  restarted, the other ranks carry on without it; a "rebuild" job's new process in its place is
  a spawned process, not this rank) until the job ends; no later event of the rank changes the
  row;
- ``waiting``: the replacement can only start from a checkpoint image and no agent can restore
  it (``rank_waiting_restore``), until it is placed or the job ends;
- ``validating``: a re-execution of the rank for validation by replay, from its placement
  (``rank_validating``, ``starting`` until it says it runs) until it exited
  (``rank_reexecuted``), was lost, or the next re-execution of the rank is placed. It replays
  its log, but the row says what it is for.

A rank's row ends at ``rank_exited`` or, in other jobs, ``rank_failed`` (no segment after: the
job fails with it; a survivor exiting non-zero fails a reporting job too, and its ``failed``
segment of no duration is dropped). ``rank_failed`` is also a fault mark. Every row ends at
the job's end event (``succeeded``, ``failed``, ``cancelled``). ``rank_validating`` starts an
ended row again: validation begins once every rank exited. The current segment of an
unfinished job ends at ``now``.

Mark kinds (``MARK_KINDS``): ``checkpoint`` (a committed image), ``fault`` (``rank_lost``,
``rank_failed``, ``checkpoint_failed``, ``restore_failed``, ``relay_down``, ``job_failed``, the
job's ``failed`` end), ``fence`` (``rank_fenced``: a replaced incarnation's late exit),
``recovery`` (``relay_up``), ``warning`` (``validation_mismatch``: a re-execution differs from
the original; ``agent_distrusted``: an agent was found wrong; ``integrity_failure``: a sealed
message changed after it was sealed) and ``corrected``
(``validation_corrected``: a rank's output was replaced by its re-executions'). Marks without a
rank are job-wide and drawn on the ``job`` row; ``mark_kind`` gives an event kind's mark kind,
for the events table to use the same classes.

The events come from the database, so ``build`` never raises on odd data: events of unknown
kinds, of ranks out of range or at non-finite times are skipped, a rank event without a rank
changes no row (its mark, if any, is job-wide), and events are taken in time order (a stable
sort: events of one instant keep their recorded order).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
from markupsafe import Markup, escape

from vpool.protocol import api

STATES: tuple[str, ...] = (
    "queued",
    "starting",
    "running",
    "replaying",
    "restored",
    "suspended",
    "lost",
    "failed",
    "waiting",
    "validating",
)
MARK_KINDS: tuple[str, ...] = ("checkpoint", "fault", "fence", "recovery", "warning", "corrected")

# Event kind -> mark kind. A mark is made whatever the event does to the rank's row.
_MARKS: dict[str, str] = {
    "checkpoint": "checkpoint",
    "rank_lost": "fault",
    "rank_failed": "fault",
    "checkpoint_failed": "fault",
    "restore_failed": "fault",
    "relay_down": "fault",
    "job_failed": "fault",
    "failed": "fault",
    "rank_fenced": "fence",
    "relay_up": "recovery",
    "validation_mismatch": "warning",
    "agent_distrusted": "warning",
    "integrity_failure": "warning",
    "validation_corrected": "corrected",
}
_JOB_ENDS = frozenset(api.TERMINAL_STATES)
# Rank events that apply to a row that ended: a rank is re-executed after it exited.
_REOPENS = frozenset({"rank_validating"})
# Rows drawn at most: the first ranks, then spawned processes up to this many rows in all (a job
# may spawn ``max_spawned`` processes, 1024 by default, over its run).
MAX_ROWS = 256
# The message of a ``spawn`` event (``coordinator/sqlite_spawn.py``): root, first and last rank.
_SPAWN = re.compile(r"rank (\d{1,9}) spawned ranks (\d{1,9}) to (\d{1,9})\b")


def mark_kind(kind: str) -> str | None:
    """The mark kind (``MARK_KINDS``) of an event kind, None if it makes no mark."""
    return _MARKS.get(kind)


class Segment(msgspec.Struct, frozen=True):
    """Rank ``rank`` was in ``state`` from ``start`` to ``end`` (seconds since the epoch).
    ``incarnation``: the incarnation it concerns (for ``lost`` and ``waiting``: the one that
    was lost), None while queued. ``label``: the message of the event that started it."""

    rank: int
    start: float
    end: float
    state: str
    incarnation: int | None
    label: str


class Mark(msgspec.Struct, frozen=True):
    """An instant: ``kind`` one of ``MARK_KINDS``; ``rank`` None for job-wide marks."""

    rank: int | None
    time: float
    kind: str
    label: str


class Row(msgspec.Struct, frozen=True):
    """Rank ``rank``'s row: ``label`` names it ("rank 5 (spawned by rank 0)"); ``start`` is the
    job's creation for a first rank, its spawn for a spawned process (None: no event says
    when it was spawned); ``spawned_by`` is the rank that spawned it, if known."""

    rank: int
    label: str
    start: float | None
    spawned: bool = False
    spawned_by: int | None = None


class Timeline(msgspec.Struct, frozen=True):
    start: float
    end: float
    ranks: int  # rows drawn: ranks 0 to ranks - 1
    segments: list[Segment]  # by rank, then start
    marks: list[Mark]  # by time
    live: bool  # the job is not over: the page should fetch it again
    rows: list[Row] = []  # one per rank drawn, in rank order
    hidden: int = 0  # spawned processes past ``MAX_ROWS``, not drawn


@dataclass
class _Row:
    rank: int
    state: str | None  # of the open segment; None once the row ended
    since: float
    label: str
    incarnation: int | None = None
    # What the current incarnation shows once it runs, and the message that said so.
    runs_as: str = "running"
    runs_label: str = ""
    # What a suspended row showed before (state, label), to show again once it resumes.
    before: tuple[str, str] | None = None
    # A spawned process's row: it starts at its spawn (``born``), no event counts before.
    spawned: bool = False
    born: bool = True
    spawned_by: int | None = None
    born_at: float | None = None

    def info(self) -> Row:
        if not self.spawned:
            return Row(rank=self.rank, label=f"rank {self.rank}", start=self.born_at)
        by = "" if self.spawned_by is None else f" by rank {self.spawned_by}"
        return Row(
            rank=self.rank,
            label=f"rank {self.rank} (spawned{by})",
            start=self.born_at,
            spawned=True,
            spawned_by=self.spawned_by,
        )


class _Builder:
    """Replays events onto one ``_Row`` per rank, collecting closed segments and marks."""

    def __init__(
        self, ranks: int, start: float, *, spawned: int = 0, reports_failures: bool = False
    ) -> None:
        self.rows = [_Row(rank, "queued", start, "queued", born_at=start) for rank in range(ranks)]
        self.rows += [
            _Row(rank, None, start, "", spawned=True, born=False)
            for rank in range(ranks, ranks + spawned)
        ]
        self.segments: list[Segment] = []
        self.marks: list[Mark] = []
        self.over = False
        # Rank event kind -> what it does to the rank's row.
        self.handlers: dict[str, Callable[[_Row, str, float], None]] = {
            "rank_running": self._rank_running,
            "rank_replaying": self._rank_replaying,
            "rank_restored": self._rank_restored,
            "rank_lost": self._rank_lost,
            "integrity_failure": self._rank_lost,
            "rank_waiting_restore": self._rank_waiting,
            "rank_restarted": self._rank_restarted,
            "rank_exited": self._rank_ended,
            "rank_failed": self._rank_failed if reports_failures else self._rank_ended,
            "rank_validating": self._rank_validating,
            "rank_reexecuted": self._rank_ended,
            "rank_suspended": self._rank_suspended,
            "rank_resumed": self._rank_resumed,
            "rank_spawned": self._rank_spawned,
        }

    def event(self, e: api.JobEvent) -> None:
        rank, t = e.rank, e.time
        if e.kind == "spawn":
            if not self.over:
                self._spawn(e)
            return
        if rank is not None and not 0 <= rank < len(self.rows):
            return
        mark = _MARKS.get(e.kind)
        if mark is not None:
            self.marks.append(Mark(rank=rank, time=t, kind=mark, label=e.message))
        if self.over:
            return  # after the job's end only marks count (e.g. a late fenced exit)
        if e.kind == "queued":
            for row in self.rows:
                if row.state == "queued" and not row.spawned:
                    row.label = e.message
        elif e.kind == "running":
            for row in self.rows:
                if row.state == "queued" and not row.spawned:
                    self._to(row, "starting", t, e.message, 1)
        elif e.kind in _JOB_ENDS:
            for row in self.rows:
                self._close(row, t)
            self.over = True
        elif rank is not None:
            handler = self.handlers.get(e.kind)
            row = self.rows[rank]
            if not row.born and e.kind == "rank_spawned":
                self._born(row, None, t, "queued")  # its spawn event is missing
            if not row.born:
                return  # not spawned yet
            if row.state == "failed":
                return  # declared failed for good: only the job's end closes the row
            if handler is not None and (row.state is not None or e.kind in _REOPENS):
                handler(row, e.message, t)

    def finish(self, t: float, *, live: bool) -> None:
        """Close the open segments at ``t``: the current states of a live job (shown even at
        their first instant), or those of a finished job whose end event is missing."""
        for row in self.rows:
            if live and row.state is not None and t <= row.since:
                self._append(row, row.since)
            self._close(row, t)

    def _spawn(self, e: api.JobEvent) -> None:
        """A ``spawn`` event: the rows of the ranks it covers start, ``queued``."""
        found = _SPAWN.match(e.message)
        if found is None:
            return
        root, first, last = (int(g) for g in found.groups())
        by = e.rank if e.rank is not None else root
        for rank in range(max(first, 0), min(last + 1, len(self.rows))):
            row = self.rows[rank]
            if not row.born:
                self._born(row, by, e.time, e.message)

    def _born(self, row: _Row, by: int | None, t: float, label: str) -> None:
        row.born, row.spawned_by, row.born_at = True, by, t
        row.state, row.since, row.label = "queued", t, label

    def _rank_spawned(self, row: _Row, message: str, t: float) -> None:
        if row.spawned and row.state == "queued":
            self._to(row, "starting", t, message, 1)

    def _rank_running(self, row: _Row, message: str, t: float) -> None:
        self._to(row, row.runs_as, t, row.runs_label or message, row.incarnation)

    def _rank_replaying(self, row: _Row, message: str, t: float) -> None:
        if row.runs_as == "validating":
            return  # a re-execution replays its log too: validating is what the row shows
        row.runs_as, row.runs_label = "replaying", message
        if row.state in ("running", "restored"):
            self._to(row, "replaying", t, message, row.incarnation)

    def _rank_restored(self, row: _Row, message: str, t: float) -> None:
        row.runs_as, row.runs_label = "restored", message
        if row.state in ("running", "replaying"):
            self._to(row, "restored", t, message, row.incarnation)

    def _rank_suspended(self, row: _Row, message: str, t: float) -> None:
        if row.state in ("starting", "running", "replaying", "restored", "validating"):
            row.before = (row.state, row.label)
            self._to(row, "suspended", t, message, row.incarnation)

    def _rank_resumed(self, row: _Row, message: str, t: float) -> None:
        if row.state == "suspended" and row.before is not None:
            state, label = row.before
            self._to(row, state, t, label, row.incarnation)
        row.before = None

    def _rank_lost(self, row: _Row, message: str, t: float) -> None:
        self._to(row, "lost", t, message, row.incarnation)

    def _rank_failed(self, row: _Row, message: str, t: float) -> None:
        self._to(row, "failed", t, message, row.incarnation)

    def _rank_waiting(self, row: _Row, message: str, t: float) -> None:
        self._to(row, "waiting", t, message, row.incarnation)

    def _rank_restarted(self, row: _Row, message: str, t: float) -> None:
        row.runs_as, row.runs_label = "running", ""
        self._to(row, "starting", t, message, (row.incarnation or 1) + 1)

    def _rank_validating(self, row: _Row, message: str, t: float) -> None:
        row.runs_as, row.runs_label = "validating", message
        self._to(row, "starting", t, message, (row.incarnation or 1) + 1)

    def _rank_ended(self, row: _Row, message: str, t: float) -> None:
        self._close(row, t)

    def _to(self, row: _Row, state: str, t: float, label: str, incarnation: int | None) -> None:
        if row.state == state and row.incarnation == incarnation:
            return
        self._close(row, t)
        row.state, row.since, row.label, row.incarnation = state, t, label, incarnation

    def _close(self, row: _Row, t: float) -> None:
        """End the row's open segment at ``t``. One of no duration is dropped: several events
        of one instant (``rank_running`` then ``rank_replaying``) make one segment."""
        if row.state is not None and t > row.since:
            self._append(row, t)
        row.state = None

    def _append(self, row: _Row, end: float) -> None:
        assert row.state is not None
        self.segments.append(
            Segment(
                rank=row.rank,
                start=row.since,
                end=end,
                state=row.state,
                incarnation=row.incarnation,
                label=row.label,
            )
        )


def build(job: api.JobInfo, events: Sequence[api.JobEvent], now: float) -> Timeline:
    """The timeline of ``job`` from its events (``api.JobDetail.events``) as of ``now``.

    It starts at the job's creation and ends at ``now`` while the job is live, at
    ``job.finished`` once it is over; in both cases at the latest event if one is later (the
    late exit of a fenced incarnation comes after the job's end)."""
    timed = sorted((e for e in events if math.isfinite(e.time)), key=lambda e: e.time)
    first = [timed[0].time] if timed else []
    last = [timed[-1].time] if timed else []
    start = min([job.created, *first]) if math.isfinite(job.created) else min([now, *first])
    live = job.state not in api.TERMINAL_STATES
    if live:
        end = now
    elif job.finished is not None:
        end = job.finished
    else:
        end = max([start, *last])
    end = max([end, start, *last]) if math.isfinite(end) else max([start, *last])
    reports = job.on_failure in api.REPORTING_MODES
    first_ranks = max(0, job.ranks)
    spawned = _spawned(first_ranks, job.spawned, timed)
    drawn = min(spawned, max(0, MAX_ROWS - first_ranks))
    builder = _Builder(first_ranks, start, spawned=drawn, reports_failures=reports)
    for e in timed:
        builder.event(e)
    builder.finish(end, live=live)
    return Timeline(
        start=start,
        end=end,
        ranks=len(builder.rows),
        segments=sorted(builder.segments, key=lambda s: (s.rank, s.start)),
        marks=builder.marks,
        live=live,
        rows=[row.info() for row in builder.rows],
        hidden=spawned - drawn,
    )


def _spawned(first_ranks: int, count: int, events: Sequence[api.JobEvent]) -> int:
    """How many processes the job spawned: ``JobInfo.spawned``, or more if its ``spawn``
    events cover more rank numbers (a detail read as a spawn was granted)."""
    last = first_ranks - 1
    for e in events:
        found = _SPAWN.match(e.message) if e.kind == "spawn" else None
        if found is not None and int(found.group(2)) >= first_ranks:
            last = max(last, int(found.group(3)))
    return max(0, count, last + 1 - first_ranks)


# -- SVG ----------------------------------------------------------------------------------------

_LABEL_WIDTH = 64  # the "rank N" column, wider for longer labels
_CHAR_WIDTH = 6.5  # of a row label's character, at most (11px system-ui, static/timeline.css)
_PAD = 6
_AXIS_HEIGHT = 22
_LEGEND_HEIGHT = 18
_SVG_NS = "http://www.w3.org/2000/svg"


def render_svg(tl: Timeline, *, width: int = 900, row_height: int = 18) -> Markup:
    """``tl`` as an inline ``<svg class="timeline">``: a ``job`` row for job-wide marks, one
    row per rank (labelled ``Row.label``; ``class="row-label spawned" data-spawned-by`` for a
    spawned process), a line "and N more spawned processes" when rows were left out, a time
    axis in seconds from the job's start, and a legend. No scripts, no style attributes:
    colours come from ``static/timeline.css``. Segments are ``<rect class="seg seg-STATE"
    data-rank data-state data-incarnation>``, marks shapes with ``class="mark mark-KIND"
    data-rank`` (``data-rank="job"`` for job-wide marks), each with a ``<title>`` tooltip."""
    labels = [_row(tl, rank) for rank in range(tl.ranks)]
    longest = max((len(row.label) for row in labels), default=0)
    label_width = max(_LABEL_WIDTH, math.ceil(longest * _CHAR_WIDTH) + _PAD)
    width = max(width, label_width + 4 * _PAD)
    row_height = max(row_height, 8)
    x0, plot = label_width, width - label_width - 2 * _PAD
    span = tl.end - tl.start
    if not (math.isfinite(span) and span > 0):
        span = 1.0
    top = _PAD

    def x(t: float) -> float:
        return x0 + (min(max(t, tl.start), tl.start + span) - tl.start) / span * plot

    def row_y(rank: int | None) -> int:
        return top + (0 if rank is None else rank + 1) * row_height

    hidden = max(0, tl.hidden)
    axis_y = row_y(tl.ranks) + (row_height if hidden else 0)
    parts: list[str] = []
    parts.append(_text("row-label", x0 - _PAD, top + row_height / 2, "job"))
    for row in labels:
        y = row_y(row.rank)
        parts.append(f'<rect class="row row-{row.rank % 2}" x="{x0}" y="{y}" ')
        parts.append(f'width="{plot}" height="{row_height}"/>')
        if row.spawned:
            by = _attr(row.spawned_by)
            parts.append(
                f'<text class="row-label spawned" data-spawned-by="{by}" '
                f'x="{x0 - _PAD:.1f}" y="{y + row_height / 2:.1f}">{escape(row.label)}</text>'
            )
        else:
            parts.append(_text("row-label", x0 - _PAD, y + row_height / 2, row.label))
    parts.extend(_axis(tl, x, span, top, axis_y))
    if hidden:  # after the ticks, so that it is drawn over them
        more = f"and {hidden} more spawned process{'es' * (hidden != 1)}"
        parts.append(_text("more", x0, row_y(tl.ranks) + row_height / 2, more))
    for seg in tl.segments:
        if not 0 <= seg.rank < tl.ranks:
            continue
        left = x(seg.start)
        inc = "" if seg.incarnation is None else f", incarnation {seg.incarnation}"
        tip = (
            f"rank {seg.rank}{inc}: {seg.state} from {_secs(seg.start - tl.start)} "
            f"to {_secs(seg.end - tl.start)}: {seg.label}"
        )
        parts.append(
            f'<rect class="seg seg-{escape(seg.state)}" data-rank="{seg.rank}" '
            f'data-state="{escape(seg.state)}" data-incarnation="{_attr(seg.incarnation)}" '
            f'x="{left:.1f}" y="{row_y(seg.rank) + 2}" '
            f'width="{max(x(seg.end) - left, 1.0):.1f}" height="{row_height - 4}">'
            f"<title>{escape(tip)}</title></rect>"
        )
    for mark in tl.marks:
        if mark.rank is not None and not 0 <= mark.rank < tl.ranks:
            continue
        parts.extend(_mark(mark, x(mark.time), row_y(mark.rank), row_height, axis_y, tl.start))
    if tl.live:
        parts.append(f'<line class="now" x1="{x(tl.end):.1f}" y1="{top}" ')
        parts.append(f'x2="{x(tl.end):.1f}" y2="{axis_y}"><title>now</title></line>')
    legend, legend_height = _legend(width, axis_y + _AXIS_HEIGHT)
    parts.extend(legend)
    height = axis_y + _AXIS_HEIGHT + legend_height + _PAD
    faults = sum(m.kind == "fault" for m in tl.marks)
    checkpoints = sum(m.kind == "checkpoint" for m in tl.marks)
    spawned = sum(row.spawned for row in labels)
    among = [f"{spawned} spawned"] if spawned else []
    among += [f"{hidden} more spawned process{'es' * (hidden != 1)} not drawn"] if hidden else []
    which = f" ({'; '.join(among)})" if among else ""
    label = (
        f"Job timeline: {tl.ranks} rank{'s' * (tl.ranks != 1)}{which} over {_secs(span)}, "
        f"{faults} fault{'s' * (faults != 1)}, "
        f"{checkpoints} checkpoint{'s' * (checkpoints != 1)}"
        f"{', live' if tl.live else ''}"
    )
    head = (
        f'<svg xmlns="{_SVG_NS}" class="timeline" role="img" aria-label="{escape(label)}" '
        f'data-live="{str(tl.live).lower()}" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}">'
    )
    return Markup(head + "".join(parts) + "</svg>")


def _axis(
    tl: Timeline, x: Callable[[float], float], span: float, top: int, axis_y: int
) -> list[str]:
    parts = [f'<line class="axis" x1="{x(tl.start):.1f}" y1="{axis_y}" ']
    parts.append(f'x2="{x(tl.start + span):.1f}" y2="{axis_y}"/>')
    step = _tick_step(span)
    for k in range(int(span / step + 1e-9) + 1):
        at = x(tl.start + k * step)
        parts.append(f'<line class="tick" x1="{at:.1f}" y1="{top}" x2="{at:.1f}" ')
        parts.append(f'y2="{axis_y + 4}"/>')
        parts.append(_text("tick-label", at, axis_y + 14, _tick_label(k * step, step)))
    return parts


def _row(tl: Timeline, rank: int) -> Row:
    """Rank ``rank``'s row; a plain one when ``tl.rows`` does not say (a hand-made timeline)."""
    if rank < len(tl.rows) and tl.rows[rank].rank == rank:
        return tl.rows[rank]
    return Row(rank=rank, label=f"rank {rank}", start=tl.start)


def _mark(mark: Mark, at: float, y: int, row_height: int, axis_y: int, start: float) -> list[str]:
    rank = "job" if mark.rank is None else str(mark.rank)
    where = "the job" if mark.rank is None else f"rank {mark.rank}"
    tip = f"{mark.kind} at {_secs(mark.time - start)}, {where}: {mark.label}"
    parts = []
    if mark.rank is None:  # job-wide: a rule across the rank rows too
        parts.append(f'<line class="mark-rule mark-rule-{escape(mark.kind)}" x1="{at:.1f}" ')
        parts.append(f'y1="{y + row_height}" x2="{at:.1f}" y2="{axis_y}"/>')
    attrs = f'class="mark mark-{escape(mark.kind)}" data-rank="{rank}"'
    parts.append(_shape(mark.kind, attrs, at, y + row_height / 2, row_height / 2 - 2, tip))
    return parts


def _shape(kind: str, attrs: str, at: float, mid: float, half: float, tip: str) -> str:
    """The shape of a mark kind centred on (``at``, ``mid``): shapes differ as well as
    colours, for readers who cannot tell the colours apart."""
    title = f"<title>{escape(tip)}</title>" if tip else ""
    if kind == "checkpoint":
        return f'<circle {attrs} cx="{at:.1f}" cy="{mid:.1f}" r="{half * 0.6:.1f}">{title}</circle>'
    if kind == "fence":
        return (
            f'<rect {attrs} x="{at - 1.5:.1f}" y="{mid - half:.1f}" width="3" '
            f'height="{2 * half:.1f}">{title}</rect>'
        )
    h = half * 0.9
    if kind == "corrected":  # a square
        return (
            f'<rect {attrs} x="{at - h * 0.8:.1f}" y="{mid - h * 0.8:.1f}" '
            f'width="{h * 1.6:.1f}" height="{h * 1.6:.1f}">{title}</rect>'
        )
    if kind == "recovery":  # a triangle pointing up
        points = [(at, mid - h), (at + h, mid + h), (at - h, mid + h)]
    elif kind == "warning":  # a triangle pointing down
        points = [(at - h, mid - h), (at + h, mid - h), (at, mid + h)]
    else:  # a fault, or a kind this renderer does not know: a diamond
        points = [(at, mid - h), (at + h, mid), (at, mid + h), (at - h, mid)]
    coords = " ".join(f"{px:.1f},{py:.1f}" for px, py in points)
    return f'<polygon {attrs} points="{coords}">{title}</polygon>'


def _legend(width: int, y: int) -> tuple[list[str], int]:
    """The legend below the axis, wrapped to ``width``; returns its parts and height."""
    items = [("seg", state) for state in STATES] + [("mark", kind) for kind in MARK_KINDS]
    parts = ['<g class="legend">']
    left, line, size = _PAD, 0, 10
    for what, name in items:
        item_width = size + 4 + 7 * len(name) + 14
        if left + item_width > width - _PAD and left > _PAD:
            left, line = _PAD, line + 1
        top = y + line * _LEGEND_HEIGHT
        if what == "seg":
            parts.append(f'<rect class="swatch seg-{name}" x="{left}" y="{top}" ')
            parts.append(f'width="{size}" height="{size}"/>')
        else:
            attrs = f'class="swatch mark-{name}"'
            parts.append(_shape(name, attrs, left + size / 2, top + size / 2, size / 2, ""))
        parts.append(_text("legend-label", left + size + 4, top + size / 2, name))
        left += item_width
    parts.append("</g>")
    return parts, (line + 1) * _LEGEND_HEIGHT


def _text(cls: str, x: float, y: float, text: str) -> str:
    return f'<text class="{cls}" x="{x:.1f}" y="{y:.1f}">{escape(text)}</text>'


def _attr(value: int | None) -> str:
    return "" if value is None else str(value)


def _secs(seconds: float) -> str:
    return f"{seconds:.1f} s"


def _tick_step(span: float, ticks: int = 6) -> float:
    """A round step (1, 2 or 5 times a power of ten) giving at most about ``ticks`` ticks."""
    raw = span / ticks
    power = 10.0 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def _tick_label(value: float, step: float) -> str:
    decimals = max(0, -math.floor(math.log10(step)))
    return f"{value:.{decimals}f} s"
