"""Output merging: whole lines per rank, whatever the chunking, and exit codes."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vpool.protocol.api import JobInfo
from vpool.sdk.output import LineAssembler, job_exit_code

STREAMS = ("stdout", "stderr")
line_text = st.binary(max_size=12).map(lambda b: b.replace(b"\n", b"."))


@st.composite
def interleaved_chunks(draw: st.DrawFn):
    """Per (rank, stream): some lines and maybe an unterminated tail, cut into chunks at
    arbitrary points; the chunks of all streams interleaved in an arbitrary order that keeps
    each stream's own order."""
    nranks = draw(st.integers(1, 4))
    originals: dict[tuple[int, str], bytes] = {}
    queues: list[list[tuple[int, str, bytes]]] = []
    for rank in range(nranks):
        for stream in STREAMS:
            lines = draw(st.lists(line_text, max_size=6))
            text = b"".join(line + b"\n" for line in lines) + draw(line_text)
            originals[(rank, stream)] = text
            cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=6)))
            bounds = [0, *cuts, len(text)]
            queues.append(
                [(rank, stream, text[a:b]) for a, b in itertools.pairwise(bounds) if b > a]
            )
    order: list[tuple[int, str, bytes]] = []
    while any(queues):
        live = [q for q in queues if q]
        order.append(draw(st.sampled_from(live)).pop(0))
    return originals, order


@given(interleaved_chunks())
def test_lines_are_whole_and_never_mixed(case) -> None:  # type: ignore[no-untyped-def]
    originals, chunks = case
    asm = LineAssembler()
    emitted = []
    for rank, stream, data in chunks:
        for item in asm.feed(rank, stream, data):
            emitted.append((item, False))
    emitted += [(item, True) for item in asm.flush()]

    got: dict[tuple[int, str], bytes] = {}
    for (rank, stream, data), final in emitted:
        assert data, "nothing empty is emitted"
        if not final:
            assert data.endswith(b"\n"), "only whole lines before the end"
        got[(rank, stream)] = got.get((rank, stream), b"") + data
    for key, text in originals.items():
        produced = got.get(key, b"")
        # The only change allowed: a newline after a final partial line, so that two ranks'
        # partial lines never share a line.
        assert produced in (text, text + b"\n"), key

    # What a terminal shows per stream: each line belongs to one rank and is one of its lines.
    for stream in STREAMS:
        shown = b"".join(d for (_r, s, d), _f in emitted if s == stream)
        wanted = {line for (r, s), t in originals.items() if s == stream for line in t.split(b"\n")}
        for line in shown.split(b"\n"):
            assert line in wanted


def test_partial_lines_at_the_end_stay_apart() -> None:
    asm = LineAssembler()
    assert asm.feed(0, "stdout", b"a\nb") == [(0, "stdout", b"a\n")]
    assert asm.feed(1, "stdout", b"c") == []
    assert asm.feed(0, "stderr", b"e") == []
    assert asm.flush() == [(0, "stderr", b"e"), (0, "stdout", b"b\n"), (1, "stdout", b"c")]
    assert asm.flush() == []


def test_labels_like_mpiexec_l() -> None:
    asm = LineAssembler(label=True)
    assert asm.feed(3, "stdout", b"x\ny\nz") == [(3, "stdout", b"[3] x\n[3] y\n")]
    assert asm.flush() == [(3, "stdout", b"[3] z")]


def job(state: str, code: int | None) -> JobInfo:
    return JobInfo(
        id=1,
        name="",
        user="u",
        state=state,
        ranks=1,  # type: ignore[arg-type]
        exit_code=code,
        reason="",
        created=0.0,
        started=None,
        finished=None,
    )


@pytest.mark.parametrize(
    ("state", "code", "expected"),
    [
        ("succeeded", 0, 0),
        ("failed", 7, 7),
        ("failed", 1, 1),
        ("failed", 255, 255),
        ("failed", 300, 1),
        ("failed", -9, 137),  # killed by SIGKILL, as a shell says
        ("failed", 0, 1),
        ("failed", None, 3),
        ("cancelled", None, 4),
        ("running", None, 1),
    ],
)
def test_exit_codes(state: str, code: int | None, expected: int) -> None:
    assert job_exit_code(job(state, code)) == expected
