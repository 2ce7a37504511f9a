"""``protocol.relay_core.RelayCore``: the relay's rules with no I/O, every rank transition."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from vpool.protocol.api import RankLost, RelayDiverged, RelayValidated
from vpool.protocol.errors import ErrorCode, LocalProtocolError, RemoteProtocolError
from vpool.protocol.messages import Det, DetAck, Error, Stop
from vpool.protocol.relay_core import (
    RANK_TRANSITIONS,
    Act,
    RankEvent,
    RankState,
    Refused,
    RelayCore,
    TrimPoint,
    may_read_image,
)

JOB, RANK, SIZE = 7, 1, 3
KEY = (JOB, RANK)
GRACE = 2.0


class Shell:
    """Records what the core asks for."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.incarnations: list[tuple[int, int, int]] = []
        self.lost: list[RankLost] = []
        self.diverged: list[RelayDiverged] = []
        self.validated: list[RelayValidated] = []

    def open_box(self, box: Any) -> None:
        box.io = "files"

    def queue_ack(self, conn: str, job: int, src: int, dst: int, seq: int) -> None:
        self.log.append(("ack", conn, job, src, dst, seq))

    def send(self, conn: str, msg: Error | DetAck | Det) -> None:
        self.log.append(("send", conn, msg))

    def stop(self, conn: str, stop: Stop) -> None:
        self.log.append(("stop", conn, stop))

    def wake(self, conn: str) -> None:
        self.log.append(("wake", conn))

    def record_incarnation(self, job: int, rank: int, incarnation: int) -> None:
        self.incarnations.append((job, rank, incarnation))

    def report_lost(self, report: RankLost) -> None:
        self.lost.append(report)

    def report_diverged(self, report: RelayDiverged) -> None:
        self.diverged.append(report)

    def report_validated(self, report: RelayValidated) -> None:
        self.validated.append(report)

    def take(self, kind: str) -> list[tuple[Any, ...]]:
        out = [e for e in self.log if e[0] == kind]
        self.log = [e for e in self.log if e[0] != kind]
        return out


def digest(frame: bytes | bytearray | memoryview) -> bytes:
    return hashlib.blake2b(frame, digest_size=16).digest()


def make() -> tuple[RelayCore[str, bytes], Shell]:
    shell = Shell()
    core: RelayCore[str, bytes] = RelayCore(
        shell, name="r0", window=1 << 20, lost_grace=GRACE, digest=digest
    )
    return core, shell


def attach(
    core: RelayCore[str, bytes],
    conn: str,
    incarnation: int,
    *,
    rank: int = RANK,
    home: bool = True,
    received: dict[int, int] | None = None,
    dets_from: int = 0,
) -> Any:
    return core.attach(
        conn,
        job=JOB,
        rank=rank,
        incarnation=incarnation,
        size=SIZE,
        home=home,
        received=received or {},
        dets_from=dets_from,
    )


# -- the rank table: every (state, event) pair ------------------------------------------------

# Pairs the core never meets: no attachment to close, no grace to end.
IMPOSSIBLE = {
    (RankState.NONE, RankEvent.CLOSED),
    (RankState.NONE, RankEvent.GRACE_OVER),
    (RankState.ATTACHED, RankEvent.GRACE_OVER),
    (RankState.GRACE, RankEvent.CLOSED),
    (RankState.LOST, RankEvent.CLOSED),
    (RankState.LOST, RankEvent.GRACE_OVER),
    (RankState.FINISHED, RankEvent.CLOSED),
    (RankState.FINISHED, RankEvent.GRACE_OVER),
}


def test_every_pair_is_a_rule_or_impossible() -> None:
    pairs = {(s, e) for s in RankState for e in RankEvent}
    assert set(RANK_TRANSITIONS) | IMPOSSIBLE == pairs
    assert not set(RANK_TRANSITIONS) & IMPOSSIBLE


def drive_to(state: RankState) -> tuple[RelayCore[str, bytes], Shell]:
    """A core with rank KEY in ``state``; its newest incarnation is 2, attached on "a"."""
    core, shell = make()
    attach(core, "a", 2)
    if state is RankState.NONE:
        core.detach("a", *KEY)
    elif state is RankState.GRACE:
        core.closed("a", "reset", now=10.0)
    elif state is RankState.LOST:
        core.closed("a", "reset", now=10.0)
        core.handle_timer(10.0 + GRACE)
    elif state is RankState.FINISHED:
        core.finish_jobs([JOB])
    assert core.rank_state(KEY) is state
    shell.log.clear()
    shell.lost.clear()
    return core, shell


def fire(core: RelayCore[str, bytes], event: RankEvent) -> Exception | None:
    try:
        if event is RankEvent.ATTACH_NEWER:
            attach(core, "b", 3)
        elif event is RankEvent.ATTACH_CURRENT:
            attach(core, "b", 2)
        elif event is RankEvent.ATTACH_STALE:
            attach(core, "b", 1)
        elif event is RankEvent.DETACH:
            core.detach("a", *KEY)
        elif event is RankEvent.CLOSED:
            core.closed("a", "reset", now=20.0)
        elif event is RankEvent.GRACE_OVER:
            core.handle_timer(1000.0)
        elif event is RankEvent.DECLARED_FAILED:
            core.declare_failed(JOB, RANK, 2)
        else:
            core.finish_jobs([JOB])
    except Refused as exc:
        return exc
    return None


@pytest.mark.parametrize(("state", "event"), sorted(RANK_TRANSITIONS, key=str))
def test_each_rule(state: RankState, event: RankEvent) -> None:
    core, shell = drive_to(state)
    nxt, acts = RANK_TRANSITIONS[(state, event)]
    refused = fire(core, event)
    assert core.rank_state(KEY) is nxt
    stops = shell.take("stop")
    if Act.REFUSE_FENCED in acts:
        assert isinstance(refused, Refused) and refused.code is ErrorCode.FENCED
    else:
        assert refused is None
    if Act.STOP_PREVIOUS in acts:
        assert [(c, s.incarnation, s.reason) for _, c, s in stops] == [
            ("a", 2, "replaced by incarnation 3")
        ]
    elif Act.STOP_FINISHED in acts:
        assert [s.reason for _, _, s in stops] == ["job finished"]
    elif Act.STOP_FAILED in acts:
        assert [(c, s.incarnation) for _, c, s in stops] == [("a", 2)]
        assert stops[0][2].reason.startswith("declared failed")
    else:
        assert stops == []
    if Act.BIND in acts:
        att = core.attachments[KEY]
        assert att.conn == "b" and core.boxes[KEY].receiver == "b"
        assert core.links["b"].attached[KEY] is att
        assert "a" not in core.links or KEY not in core.links["a"].attached
    if Act.REPORT_LOST in acts:
        assert [(r.rank, r.incarnation, r.reason) for r in shell.lost] == [(RANK, 2, "reset")]
    else:
        assert shell.lost == []
    if nxt is RankState.GRACE:
        assert core.next_timer() is not None
    elif nxt is not RankState.ATTACHED:
        assert core.next_timer() is None


@pytest.mark.parametrize(("state", "event"), sorted(IMPOSSIBLE, key=str))
def test_impossible_pairs_are_refused_by_the_core(state: RankState, event: RankEvent) -> None:
    core, _ = drive_to(state)
    with pytest.raises(LocalProtocolError):
        core._step(KEY, event)


# -- fencing and attachments --------------------------------------------------------------------


def test_a_newer_incarnation_is_recorded_and_the_old_ones_frames_are_dropped() -> None:
    core, shell = make()
    attach(core, "a", 1)
    attach(core, "b", 2)
    assert shell.incarnations == [(JOB, RANK, 2)]
    # Rank 1's old incarnation still sends on "a": fenced, dropped quietly.
    assert core.deposit("a", JOB, RANK, 0, 1, b"x") is None
    assert core.det("a", JOB, RANK, 0) is None


def test_a_rank_declared_failed_is_fenced_for_good_but_a_newer_incarnation_may_attach() -> None:
    core, shell = make()
    attach(core, "a", 2)
    core.declare_failed(JOB, RANK, 2)
    assert [(c, s.incarnation) for _, c, s in shell.take("stop")] == [("a", 2)]
    # On disk (a restarted relay keeps the fence): the attachment's, then the fence's.
    assert shell.incarnations == [(JOB, RANK, 2), (JOB, RANK, 3)]
    # Its late frames are dropped; it cannot come back, on that connection or another.
    assert core.deposit("a", JOB, RANK, 0, 1, b"x") is None
    for conn in ("a", "b"):
        with pytest.raises(Refused) as info:
            attach(core, conn, 2)
        assert info.value.code is ErrorCode.FENCED
    # Said again (the coordinator repeats it until it hears back): nothing more happens.
    core.declare_failed(JOB, RANK, 2)
    assert shell.take("stop") == [] and shell.incarnations[-1] == (JOB, RANK, 3)
    assert len(shell.incarnations) == 2
    # A fence for an older incarnation than one attached leaves the newer one alone.
    attach(core, "b", 3)
    core.declare_failed(JOB, RANK, 2)
    assert core.rank_state(KEY) is RankState.ATTACHED and shell.take("stop") == []


def test_frames_of_a_rank_never_attached_here_end_the_connection() -> None:
    core, _ = make()
    core.link("a")
    with pytest.raises(Refused) as info:
        core.deposit("a", JOB, 2, 0, 1, b"x")
    assert info.value.code is ErrorCode.NOT_ATTACHED
    attach(core, "a", 1, home=False)
    with pytest.raises(Refused) as info:
        core.deposit("a", JOB, RANK, SIZE, 1, b"x")
    assert info.value.code is ErrorCode.BAD_DST
    with pytest.raises(Refused) as info:
        core.det("a", JOB, RANK, 0)
    assert info.value.code is ErrorCode.NOT_HOME


def test_a_reconnect_within_the_grace_is_not_a_loss() -> None:
    core, shell = make()
    attach(core, "a", 1)
    core.closed("a", "reset", now=5.0)
    assert core.next_timer() == 5.0 + GRACE
    core.handle_timer(5.0 + GRACE / 2)
    attach(core, "b", 1)
    core.handle_timer(100.0)
    assert shell.lost == [] and core.next_timer() is None


def test_a_home_attachment_below_the_trim_point_is_refused() -> None:
    core, _ = make()
    box = core.box(JOB, RANK)
    box.trim = TrimPoint({0: 5}, dets=3)
    with pytest.raises(Refused) as info:
        attach(core, "a", 2, received={0: 4}, dets_from=3)
    assert info.value.code is ErrorCode.TRIMMED and "messages <= 5" in info.value.message
    with pytest.raises(Refused) as info:
        attach(core, "a", 2, received={0: 5}, dets_from=2)
    assert info.value.code is ErrorCode.TRIMMED and "determinants below 3" in info.value.message
    assert attach(core, "a", 2, received={0: 5}, dets_from=3) is not None


# -- deposits, acks, determinism ----------------------------------------------------------------


def deposit_new(core: RelayCore[str, bytes], conn: str, src: int, dst: int, seq: int) -> None:
    frame = f"{src}->{dst}#{seq}".encode()
    box = core.deposit(conn, JOB, src, dst, seq, frame)
    assert box is not None
    box.mailbox.append(src, seq, len(frame), frame, digest(frame))


def write_all(core: RelayCore[str, bytes], dst: int) -> None:
    box = core.boxes[(JOB, dst)]
    for e in box.mailbox.entries():
        e.written = True
    core.written(box)


def test_acks_are_cumulative_and_never_claim_what_the_attachment_did_not_send() -> None:
    core, shell = make()
    attach(core, "s", 1, rank=0, home=False)
    attach(core, "d", 1, rank=2)
    for seq in (1, 2, 3):
        deposit_new(core, "s", 0, 2, seq)
    write_all(core, 2)
    assert shell.take("wake")[-1] == ("wake", "d")
    assert shell.take("ack") == [("ack", "s", JOB, 0, 2, 3)]
    # Rank 0 restarts: incarnation 2 re-sends message 1 only; it is told about 1, not 3.
    attach(core, "s2", 2, rank=0, home=False)
    assert core.deposit("s2", JOB, 0, 2, 1, b"0->2#1") is None
    assert shell.take("ack") == [("ack", "s2", JOB, 0, 2, 1)]


def test_a_copy_with_other_content_is_a_divergence_reported_once() -> None:
    core, shell = make()
    attach(core, "s", 1, rank=0, home=False)
    deposit_new(core, "s", 0, 2, 1)
    deposit_new(core, "s", 0, 2, 2)
    write_all(core, 2)
    attach(core, "s2", 2, rank=0, home=False)
    assert core.deposit("s2", JOB, 0, 2, 1, b"something else") is None
    [(_, conn, err)] = shell.take("send")
    assert conn == "s2" and err.code == ErrorCode.NOT_DETERMINISTIC and err.rank == 0
    assert "re-sent message 1 to rank 2" in err.message
    # The rank's further deposits are dropped, and it is reported once.
    assert core.deposit("s2", JOB, 0, 2, 2, b"0->2#2") is None
    assert [(d.rank, d.incarnation) for d in shell.diverged] == [(0, 2)]


def test_a_copy_of_a_frame_whose_digest_is_late_is_checked_when_it_comes() -> None:
    core, shell = make()
    attach(core, "s", 1, rank=0, home=False)
    box = core.deposit("s", JOB, 0, 2, 1, b"big")
    assert box is not None
    entry = box.mailbox.append(0, 1, 3, b"big")  # digest computed later
    attach(core, "s2", 2, rank=0, home=False)
    assert core.deposit("s2", JOB, 0, 2, 1, b"BIG") is None
    assert shell.diverged == []
    entry.digest = digest(b"big")
    core.digested(entry)
    assert [d.rank for d in shell.diverged] == [0]


def test_a_gap_in_a_channel_is_the_peers_fault() -> None:
    core, _ = make()
    attach(core, "s", 1, rank=0, home=False)
    with pytest.raises(RemoteProtocolError) as info:
        core.deposit("s", JOB, 0, 2, 2, b"x")
    assert info.value.code == ErrorCode.SEQ_GAP


def test_determinants_are_acked_by_count_and_replayed_to_a_home_attachment() -> None:
    core, shell = make()
    attach(core, "a", 1)
    for index in (0, 1):
        box = core.det("a", JOB, RANK, index)
        assert box is not None
        box.dets.append(index, Det(job=JOB, rank=RANK, index=index, data=b"%d" % index))
        box.dets.written(index)
    assert core.dets_written(core.boxes[KEY]) == 2
    [(_, conn, ack)] = shell.take("send")
    assert conn == "a" and ack == DetAck(job=JOB, rank=RANK, count=2)
    # A resent one is dropped and the count said again.
    assert core.det("a", JOB, RANK, 1) is None
    assert shell.take("send") == [("send", "a", DetAck(job=JOB, rank=RANK, count=2))]
    attach(core, "b", 2)
    count, replay = core.replay_dets(JOB, RANK, 1)
    assert count == 2 and [d.index for d in replay] == [1]


def test_credit_wakes_the_receiver_when_it_can_push() -> None:
    core, shell = make()
    core.window = 10
    attach(core, "s", 1, rank=0, home=False)
    attach(core, "d", 1, rank=2)
    shell.log.clear()
    deposit_new(core, "s", 0, 2, 1)
    deposit_new(core, "s", 0, 2, 2)
    write_all(core, 2)
    box = core.boxes[(JOB, 2)]
    box.mailbox.push_window.size = 6  # type: ignore[misc]
    assert box.mailbox.next_push(0.0) is not None
    assert box.mailbox.next_push(0.0) is None
    shell.log.clear()
    core.credit("d", JOB, 2, 6, 0.1)
    assert shell.take("wake") == [("wake", "d")]


def test_a_finished_job_stops_its_ranks_and_gives_back_its_boxes() -> None:
    core, shell = make()
    attach(core, "a", 1)
    attach(core, "b", 1, rank=2, home=False)
    gone = core.finish_jobs([JOB])
    assert {(b.job, b.dst) for b in gone} == {KEY} and all(b.dead for b in gone)
    assert {(c, s.rank) for _, c, s in shell.take("stop")} == {("a", RANK), ("b", 2)}
    assert core.attachments == {} and core.boxes == {}
    # Late frames of the job are dropped; a late attachment is told to stop.
    assert core.deposit("a", JOB, RANK, 0, 1, b"x") is None
    assert attach(core, "c", 1) is None
    assert [s.reason for _, _, s in shell.take("stop")] == ["job finished"]


def test_images_of_replaced_incarnations_are_fenced() -> None:
    core, _ = make()
    attach(core, "a", 3)
    assert core.image_replaced(KEY, 3, []) is None
    assert core.image_replaced(KEY, 2, []) == 3
    assert core.image_replaced(KEY, 3, [4, 1]) == 4  # the store holds a newer one's image
    assert may_read_image(3, 2) and may_read_image(3, 3) and not may_read_image(2, 3)


# -- agent-local delivery -----------------------------------------------------------------------


def pushed(core: RelayCore[str, bytes], dst: int) -> list[tuple[int, int]]:
    box = core.boxes[(JOB, dst)]
    out = []
    while (entry := box.mailbox.next_push()) is not None:
        out.append((entry.src, entry.seq))
    return out


def test_a_message_the_agent_delivered_is_logged_and_acked_but_not_pushed_back() -> None:
    core, shell = make()
    attach(core, "a", 1, rank=0, home=False)  # sender and receiver on one agent: "a"
    attach(core, "a", 1, rank=2)
    deposit_new(core, "a", 0, 2, 1)
    core.delivered("a", JOB, 2, 1, 0, 1)
    deposit_new(core, "a", 0, 2, 2)  # this one took the relay's way
    write_all(core, 2)
    assert shell.take("ack") == [("ack", "a", JOB, 0, 2, 2)]
    assert pushed(core, 2) == [(0, 2)]
    # A restarted receiver (incarnation 2, from the beginning) gets both pushed.
    attach(core, "b", 2, rank=2)
    assert pushed(core, 2) == [(0, 1), (0, 2)]


def test_a_delivered_notice_counts_only_for_that_incarnation_on_that_connection() -> None:
    core, _ = make()
    attach(core, "a", 1, rank=0, home=False)
    attach(core, "b", 2, rank=2)  # the receiver's newest incarnation is elsewhere
    deposit_new(core, "a", 0, 2, 1)
    core.delivered("a", JOB, 2, 1, 0, 1)  # a late notice for incarnation 1: dropped
    core.delivered("b", JOB, 2, 1, 0, 1)  # the right connection, the wrong incarnation
    write_all(core, 2)
    assert pushed(core, 2) == [(0, 1)]
    attach(core, "a", 1, rank=1, home=False)
    core.delivered("a", JOB, 1, 1, 0, 1)  # rank 1 is not home-attached here: nothing to do
    assert core.rank_state((JOB, 1)) is RankState.ATTACHED


def test_a_delivered_notice_from_outside_the_job_is_refused() -> None:
    core, _ = make()
    attach(core, "a", 1, rank=2)
    with pytest.raises(Refused) as info:
        core.delivered("a", JOB, 2, 1, SIZE, 1)
    assert info.value.code is ErrorCode.BAD_DST and info.value.rank == 2
