"""``RelayCore`` and validating attachments (validation by replay): a rank re-executed from its
log may only re-send what the original sent, with the same content, and all of it; the relay
gives one verdict per incarnation (``RelayValidated``)."""

from __future__ import annotations

from typing import Any

import pytest

from vpool.protocol.errors import ErrorCode
from vpool.protocol.relay_core import RankState, RelayCore

from .test_relay_core import JOB, SIZE, Shell, deposit_new, digest, make, write_all

ORIGINAL, REPLAY = 1, 2  # incarnations of rank 0: the original run, its re-execution


def attach(
    core: RelayCore[str, bytes],
    conn: str,
    incarnation: int,
    *,
    rank: int = 0,
    home: bool = False,
    validating: bool = False,
) -> Any:
    return core.attach(
        conn,
        job=JOB,
        rank=rank,
        incarnation=incarnation,
        size=SIZE,
        home=home,
        received={},
        validating=validating,
    )


def frame(src: int, dst: int, seq: int) -> bytes:
    """What ``deposit_new`` logs for (src, dst, seq)."""
    return f"{src}->{dst}#{seq}".encode()


def original_run(sent: dict[int, int]) -> tuple[RelayCore[str, bytes], Shell]:
    """A core whose log holds what rank 0's original incarnation sent (``sent[dst]`` messages
    to each ``dst``), written, and that incarnation detached as at the end of its job."""
    core, shell = make()
    attach(core, "o", ORIGINAL)
    for dst, count in sent.items():
        for seq in range(1, count + 1):
            deposit_new(core, "o", 0, dst, seq)
        write_all(core, dst)
    core.detach("o", JOB, 0)
    shell.log.clear()
    return core, shell


def resend(core: RelayCore[str, bytes], conn: str, dst: int, seqs: range) -> None:
    for seq in seqs:
        assert core.deposit(conn, JOB, 0, dst, seq, frame(0, dst, seq)) is None


def test_a_replay_that_resends_everything_agrees_once_it_detaches() -> None:
    core, shell = original_run({1: 2, 2: 3})
    att = attach(core, "v", REPLAY, validating=True)
    assert att.validating
    resend(core, "v", 2, range(1, 4))
    resend(core, "v", 1, range(1, 3))
    # Logged already: each copy is acked (as far as the replay sent), nothing is written.
    assert shell.take("ack")[-1] == ("ack", "v", JOB, 0, 1, 2)
    assert [len(core.boxes[(JOB, d)].mailbox) for d in (1, 2)] == [2, 3]
    assert shell.validated == []  # no verdict before the rank ended
    core.detach("v", JOB, 0)
    [report] = shell.validated
    assert (report.name, report.job, report.rank, report.incarnation) == ("r0", JOB, 0, REPLAY)
    assert (report.agreed, report.message) == (True, "")
    assert shell.diverged == [] and shell.take("send") == []


def test_a_replay_whose_copy_differs_disagrees_and_is_not_reported_diverged() -> None:
    core, shell = original_run({2: 2})
    attach(core, "v", REPLAY, validating=True)
    assert core.deposit("v", JOB, 0, 2, 1, b"forged") is None
    message = (
        "rank 0 re-executed for validation sent message seq 1 to rank 2 with content other "
        "than the original run's"
    )
    [(_, conn, err)] = shell.take("send")
    assert (conn, err.code, err.job, err.rank, err.message) == (
        "v",
        ErrorCode.NOT_DETERMINISTIC,
        JOB,
        0,
        message,
    )
    assert [(r.incarnation, r.agreed, r.message) for r in shell.validated] == [
        (REPLAY, False, message)
    ]
    assert shell.diverged == []
    # Its further deposits are dropped (no ack), and its detach gives no second verdict.
    shell.log.clear()
    assert core.deposit("v", JOB, 0, 2, 2, frame(0, 2, 2)) is None
    assert shell.log == []
    core.detach("v", JOB, 0)
    assert len(shell.validated) == 1


def test_a_replay_sending_a_message_the_original_never_sent_disagrees_and_nothing_is_logged() -> (
    None
):
    core, shell = original_run({2: 2})
    attach(core, "d", 1, rank=2, home=True)  # the receiver, so a logged message would be pushed
    attach(core, "v", REPLAY, validating=True)
    resend(core, "v", 2, range(1, 3))
    shell.log.clear()
    assert core.deposit("v", JOB, 0, 2, 3, frame(0, 2, 3)) is None  # NEW: not the shell's to log
    message = (
        "rank 0 re-executed for validation sent message seq 3 to rank 2, which the original "
        "run never sent"
    )
    assert [(e[1], e[2].code, e[2].message) for e in shell.take("send")] == [
        ("v", ErrorCode.NOT_DETERMINISTIC, message)
    ]
    assert shell.log == []  # no ack, no wake of the receiver
    mailbox = core.boxes[(JOB, 2)].mailbox
    assert (len(mailbox), mailbox.stored(0)) == (2, 2)
    assert [(r.agreed, r.message) for r in shell.validated] == [(False, message)]
    # Dropped from now on, even past the gap its seq 3 left in the log.
    assert core.deposit("v", JOB, 0, 2, 4, frame(0, 2, 4)) is None
    core.detach("v", JOB, 0)
    assert len(shell.validated) == 1 and shell.diverged == []


def test_a_replay_sending_to_a_rank_with_no_log_here_disagrees_without_making_one() -> None:
    core, shell = original_run({2: 1})
    attach(core, "v", REPLAY, validating=True)
    assert core.deposit("v", JOB, 0, 1, 1, frame(0, 1, 1)) is None
    assert (JOB, 1) not in core.boxes
    [report] = shell.validated
    assert not report.agreed and "seq 1 to rank 1, which the original run never sent" in (
        report.message
    )


def test_a_replay_that_ends_having_sent_less_disagrees_naming_the_counts() -> None:
    core, shell = original_run({1: 2, 2: 5})
    attach(core, "v", REPLAY, validating=True)
    resend(core, "v", 2, range(1, 4))
    resend(core, "v", 1, range(1, 3))
    core.detach("v", JOB, 0)
    [report] = shell.validated
    assert (report.incarnation, report.agreed) == (REPLAY, False)
    assert report.message == (
        "rank 0 re-executed for validation sent 3 messages to rank 2; the original sent 5"
    )
    assert shell.take("send") == []  # the rank is gone: nobody to tell


def test_every_rank_short_is_named() -> None:
    core, shell = original_run({1: 2, 2: 1})
    attach(core, "v", REPLAY, validating=True)
    core.detach("v", JOB, 0)
    [report] = shell.validated
    assert report.message == (
        "rank 0 re-executed for validation sent 0 messages to rank 1; the original sent 2; "
        "rank 0 re-executed for validation sent 0 messages to rank 2; the original sent 1"
    )


@pytest.mark.parametrize("same", [True, False])
def test_the_verdict_waits_for_the_digest_of_a_logged_frame(same: bool) -> None:
    core, shell = make()
    attach(core, "o", ORIGINAL)
    box = core.deposit("o", JOB, 0, 2, 1, b"big")
    assert box is not None
    entry = box.mailbox.append(0, 1, 3, b"big")  # its digest is computed later (big frames)
    write_all(core, 2)
    core.detach("o", JOB, 0)
    attach(core, "v", REPLAY, validating=True)
    assert core.deposit("v", JOB, 0, 2, 1, b"big" if same else b"BIG") is None
    core.detach("v", JOB, 0)
    assert shell.validated == []  # the copy may still differ
    entry.digest = digest(b"big")
    core.digested(entry)
    assert [r.agreed for r in shell.validated] == [same]
    assert shell.diverged == []


def test_a_closed_connection_is_no_verdict_and_the_incarnation_goes_on_where_it_was() -> None:
    core, shell = original_run({2: 3})
    attach(core, "v", REPLAY, validating=True)
    resend(core, "v", 2, range(1, 3))
    core.closed("v", "reset", now=1.0)
    assert core.rank_state((JOB, 0)) is RankState.GRACE
    assert shell.validated == []
    # Its agent reconnects: messages 1 and 2 were acked, it re-sends only 3.
    attach(core, "v2", REPLAY, validating=True)
    resend(core, "v2", 2, range(3, 4))
    core.detach("v2", JOB, 0)
    assert [(r.incarnation, r.agreed) for r in shell.validated] == [(REPLAY, True)]


def test_each_validating_incarnation_gets_its_verdict() -> None:
    core, shell = original_run({2: 1})
    attach(core, "v", REPLAY, validating=True)
    assert core.deposit("v", JOB, 0, 2, 1, b"forged") is None
    # A third execution decides: a newer incarnation, judged on its own.
    attach(core, "w", REPLAY + 1, validating=True)
    resend(core, "w", 2, range(1, 2))
    core.detach("w", JOB, 0)
    assert [(r.incarnation, r.agreed) for r in shell.validated] == [
        (REPLAY, False),
        (REPLAY + 1, True),
    ]


def test_each_incarnation_that_diverges_is_reported() -> None:
    core, shell = original_run({2: 1})
    for incarnation, conn in ((2, "a"), (2, "a2"), (3, "b")):
        attach(core, conn, incarnation)
        assert core.deposit(conn, JOB, 0, 2, 1, b"other") is None
    assert [r.incarnation for r in shell.diverged] == [2, 3]  # a reconnect is no new report
    assert shell.validated == []


def test_a_replay_may_not_log_determinants_the_original_never_made() -> None:
    core, shell = make()
    attach(core, "o", ORIGINAL, home=True)
    for index in (0, 1):
        box = core.det("o", JOB, 0, index)
        assert box is not None
        box.dets.append(index, index)
        box.dets.written(index)
    core.dets_written(core.boxes[(JOB, 0)])
    core.detach("o", JOB, 0)
    shell.log.clear()
    attach(core, "v", REPLAY, home=True, validating=True)
    assert core.det("v", JOB, 0, 0) is None  # logged already: DetAck again
    assert core.det("v", JOB, 0, 2 - 1) is None
    assert core.det("v", JOB, 0, 2) is None  # new: refused, not the shell's to log
    assert len(core.boxes[(JOB, 0)].dets) == 2
    [report] = shell.validated
    assert not report.agreed
    assert report.message == (
        "rank 0 re-executed for validation made determinant 2, which the original run never made"
    )


def test_an_ordinary_incarnation_logs_new_messages_and_gets_no_verdict() -> None:
    core, shell = original_run({2: 2})
    att = attach(core, "n", REPLAY)
    assert not att.validating
    resend(core, "n", 2, range(1, 3))
    assert core.deposit("n", JOB, 0, 2, 3, frame(0, 2, 3)) is not None  # the shell logs it
    core.detach("n", JOB, 0)
    assert shell.validated == [] and shell.diverged == []


def test_a_finished_job_drops_a_verdict_still_due() -> None:
    core, shell = make()
    attach(core, "o", ORIGINAL)
    box = core.deposit("o", JOB, 0, 2, 1, b"big")
    assert box is not None
    entry = box.mailbox.append(0, 1, 3, b"big")
    write_all(core, 2)
    attach(core, "v", REPLAY, validating=True)
    assert core.deposit("v", JOB, 0, 2, 1, b"big") is None
    core.detach("v", JOB, 0)
    core.finish_jobs([JOB])
    assert not core.validations and not core.waiting
    entry.digest = digest(b"big")
    core.digested(entry)
    assert shell.validated == []
