"""The relay <-> store process link (``storelink``): typed requests and answers, in memory.

Every request and answer round-trips through the link's encoder and typed decoders; a packet
with an unknown tag, a missing or unknown field or a field of the wrong type is refused as a
whole. The store process's side (``storeworker.RelayLink``) runs on a socketpair, its reader
and a scripted relay in threads of this process: no process is started.
"""

from __future__ import annotations

import logging
import socket
import threading
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from vpool.protocol.errors import ErrorCode
from vpool.protocol.relay_core import Refused
from vpool.protocol.tokens import RankClaims
from vpool.relay.ckptstore import Image
from vpool.relay.storelink import (
    MAX_PACKET,
    Answer,
    BeginPut,
    Call,
    Commit,
    Committed,
    Conn,
    Done,
    Ended,
    EndUpload,
    Found,
    Granted,
    ImageAsk,
    Init,
    JobFinished,
    JobState,
    NoAnswer,
    NotFound,
    Refusal,
    Reply,
    Request,
    SigningKey,
    SigningKeyAsk,
    encode,
    from_worker,
    to_worker,
)
from vpool.relay.storeworker import LinkClosed, RelayLink

DEADLINE = 10.0

IMAGE = Image(
    job=3,
    rank=1,
    ckpt=7,
    incarnation=2,
    size=1234,
    digest=bytes(range(32)),
    received={0: 5, 2: 9},
    dets=4,
    fingerprint="fp",
    meta=b"\x00meta",
    directory=Path("/data/ckpt/3/1"),
)

REQUESTS: list[Request] = [
    SigningKeyAsk(),
    BeginPut(job=3, rank=1, incarnation=2, ckpt=7),
    EndUpload(job=3, rank=1),
    JobFinished(job=3),
    Commit(manifest=IMAGE.to_json(), directory=str(IMAGE.directory), wait=2.5),
    ImageAsk(job=3, rank=1, ckpt=7),
]

ANSWERS: list[Answer] = [
    SigningKey(raw=b"k" * 32),
    SigningKey(raw=None),
    Granted(),
    Refusal(code=ErrorCode.BUSY, message="rank 1 of job 3 is uploading"),
    Done(),
    JobState(finished=True),
    Committed(retained=[5, 7], known=True),
    Committed(retained=[7], known=None),
    Found(manifest=IMAGE.to_json(), directory=str(IMAGE.directory)),
    NotFound(),
    NoAnswer(error="store session 4 is over"),
]

INIT = Init(
    name="relay-a",
    data_dir="/data",
    handshake_timeout=5.0,
    store_idle_timeout=60.0,
    checkpoint_max_bytes=1 << 30,
    store_report_wait=2.0,
    bulk=True,
    tls_cert="",
    tls_key="",
    log_level=logging.INFO,
)


def test_every_request_and_answer_round_trips() -> None:
    assert {type(r) for r in REQUESTS} == set(typing.get_args(Request))
    assert {type(a) for a in ANSWERS} == set(typing.get_args(Answer))
    for rid, request in enumerate(REQUESTS):
        call = Call(rid=rid, cid=4, request=request)
        assert from_worker.decode(encode(call)) == call
    for rid, answer in enumerate(ANSWERS):
        reply = Reply(rid=rid, value=answer)
        assert to_worker.decode(encode(reply)) == reply
    for msg in (INIT, Conn(cid=4, peer="10.0.0.1:5000")):
        assert to_worker.decode(encode(msg)) == msg
    ended = Ended(cid=4, reason="the agent closed the store connection")
    assert from_worker.decode(encode(ended)) == ended
    # The code is the ErrorCode, not a string that looks like one.
    reply = to_worker.decode(encode(Reply(rid=1, value=ANSWERS[3])))
    assert isinstance(reply, Reply) and isinstance(reply.value, Refusal)
    assert type(reply.value.code) is ErrorCode


def _call(request: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode({"type": "Call", "rid": 1, "cid": 4, "request": request})


def _reply(value: dict[str, Any], rid: int = 1) -> bytes:
    return msgspec.msgpack.encode({"type": "Reply", "rid": rid, "value": value})


BEGIN = {"type": "BeginPut", "job": 3, "rank": 1, "incarnation": 2, "ckpt": 7}


@pytest.mark.parametrize(
    "packet",
    [
        _call({"type": "NoSuchCall"}),  # an unknown request
        _call({"type": "begin_put", "job": 3, "rank": 1, "incarnation": 2, "ckpt": 7}),
        _call({**BEGIN, "job": "3"}),  # a field of the wrong type
        _call({**BEGIN, "ckpt": 7.5}),
        _call({k: v for k, v in BEGIN.items() if k != "ckpt"}),  # a missing field
        _call({**BEGIN, "extra": 1}),  # an unknown field
        _call({"type": "Commit", "manifest": "{}", "directory": "/", "wait": 1.0}),
        _call({"type": "JobFinished"}),
        _call({"type": "Granted"}),  # an answer where a request goes
        msgspec.msgpack.encode({"type": "Call", "rid": 1, "cid": 4, "op": "commit", "args": []}),
        msgspec.msgpack.encode({"type": "NoSuchMessage", "cid": 4}),
        msgspec.msgpack.encode({"type": "Ended", "cid": "4", "reason": "x"}),
        encode(Reply(rid=1, value=Done())),  # a message of the other direction
        msgspec.msgpack.encode(["Call", 1, 4, {"type": "SigningKeyAsk"}]),
        b"\xc1 not msgpack",
    ],
)
def test_the_relay_refuses_malformed_packets(packet: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        from_worker.decode(packet)


@pytest.mark.parametrize(
    "packet",
    [
        _reply({"type": "NoSuchAnswer"}),
        _reply(BEGIN),  # a request where an answer goes
        _reply({"type": "Refusal", "code": "no_such_code", "message": "x"}),
        _reply({"type": "Refusal", "code": 3, "message": "x"}),
        _reply({"type": "Committed", "retained": ["7"], "known": True}),
        _reply({"type": "Committed", "retained": [7], "known": "yes"}),
        _reply({"type": "Committed", "retained": [7]}),
        _reply({"type": "SigningKey", "raw": "not bytes"}),
        _reply({"type": "JobState", "finished": 1}),
        _reply({"type": "Found", "manifest": b"{}"}),
        msgspec.msgpack.encode({"type": "Reply", "rid": 1, "value": None}),
        msgspec.msgpack.encode({"type": "Reply", "rid": 1, "value": None, "error": "over"}),
        msgspec.msgpack.encode({"type": "Conn", "cid": 4}),
        encode(Call(rid=1, cid=4, request=SigningKeyAsk())),  # a message of the other direction
        b"",
    ],
)
def test_the_store_process_refuses_malformed_packets(packet: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        to_worker.decode(packet)


# -- RelayLink on a socketpair --------------------------------------------------------------


class FakeRelay:
    """The relay's end of the link: answers each Call with ``answer(request)`` (None: no
    reply) from a thread; ``raw(rid)`` instead sends those bytes as the reply."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.requests: list[Request] = []
        self.answer: Callable[[Request], Answer] = lambda request: NoAnswer(error="unscripted")
        self.raw: Callable[[int], bytes] | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while data := self.sock.recv(MAX_PACKET):
            call = from_worker.decode(data)
            assert isinstance(call, Call)
            self.requests.append(call.request)
            if self.raw is not None:
                self.sock.send(self.raw(call.rid))
            else:
                self.sock.send(encode(Reply(rid=call.rid, value=self.answer(call.request))))


@pytest.fixture
def link() -> Iterator[tuple[RelayLink, FakeRelay]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    worker = RelayLink(ours, INIT)
    reader = threading.Thread(target=worker.serve, args=(None,), daemon=True)
    reader.start()
    relay = FakeRelay(theirs)
    try:
        yield worker, relay
    finally:
        theirs.shutdown(socket.SHUT_RDWR)
        reader.join(DEADLINE)
        relay.thread.join(DEADLINE)
        assert not reader.is_alive() and not relay.thread.is_alive()
        ours.close()
        theirs.close()


def test_relay_link_asks_typed_requests(link: tuple[RelayLink, FakeRelay]) -> None:
    worker, relay = link
    claims = RankClaims(job=3, rank=1, incarnation=2, size=4, agent="agent-a", expires=0.0)
    key = Ed25519PrivateKey.generate().public_key()
    answers: list[Answer] = [
        SigningKey(raw=key.public_bytes_raw()),
        SigningKey(raw=None),
        Granted(),
        Refusal(code=ErrorCode.STALE_CHECKPOINT, message="image 7 is older"),
        Done(),
        JobState(finished=True),
        JobState(finished=False),
        Committed(retained=[5, 7], known=False),
        Refusal(code=ErrorCode.JOB_FINISHED, message="job 3 is over"),
        Found(manifest=IMAGE.to_json(), directory=str(IMAGE.directory)),
        NotFound(),
    ]
    relay.answer = lambda request: answers.pop(0)
    got = worker.signing_key(4)
    assert got is not None and got.public_bytes_raw() == key.public_bytes_raw()
    assert worker.signing_key(4) is None
    assert worker.begin_put(4, claims, 7) is None
    rej = worker.begin_put(4, claims, 7)
    assert isinstance(rej, Refused)
    assert (rej.code, rej.message, rej.job, rej.rank) == (
        ErrorCode.STALE_CHECKPOINT,
        "image 7 is older",
        3,
        1,
    )
    worker.end_upload(4, (3, 1))
    assert worker.job_finished(4, 3) is True
    assert worker.job_finished(4, 3) is False
    assert worker.commit(4, IMAGE, 2.5) == ([5, 7], False)
    refused, known = worker.commit(4, IMAGE, 2.5)
    assert isinstance(refused, Refused) and known is None
    assert (refused.code, refused.job, refused.rank) == (ErrorCode.JOB_FINISHED, 3, 1)
    assert worker.image(4, (3, 1), 7) == IMAGE
    assert worker.image(4, (3, 1), 8) is None
    assert not answers
    assert relay.requests == [
        SigningKeyAsk(),
        SigningKeyAsk(),
        BeginPut(job=3, rank=1, incarnation=2, ckpt=7),
        BeginPut(job=3, rank=1, incarnation=2, ckpt=7),
        EndUpload(job=3, rank=1),
        JobFinished(job=3),
        JobFinished(job=3),
        Commit(manifest=IMAGE.to_json(), directory=str(IMAGE.directory), wait=2.5),
        Commit(manifest=IMAGE.to_json(), directory=str(IMAGE.directory), wait=2.5),
        ImageAsk(job=3, rank=1, ckpt=7),
        ImageAsk(job=3, rank=1, ckpt=8),
    ]


def test_no_answer_or_another_answer_ends_the_session(
    link: tuple[RelayLink, FakeRelay],
) -> None:
    """``NoAnswer``, or an answer that is not one of the request's, is ``LinkClosed`` (an
    ``OSError``: the session's thread ends as if the link were gone)."""
    worker, relay = link
    relay.answer = lambda request: NoAnswer(error="store session 4 is over")
    with pytest.raises(LinkClosed, match="store session 4 is over"):
        worker.job_finished(4, 3)
    relay.answer = lambda request: Granted()
    with pytest.raises(LinkClosed, match="answered JobFinished with Granted"):
        worker.job_finished(4, 3)
    relay.answer = lambda request: JobState(finished=True)
    claims = RankClaims(job=3, rank=1, incarnation=2, size=4, agent="a", expires=0.0)
    with pytest.raises(LinkClosed, match="answered BeginPut with JobState"):
        worker.begin_put(4, claims, 7)
    with pytest.raises(LinkClosed, match="answered ImageAsk with JobState"):
        worker.image(4, (3, 1), 7)
    assert issubclass(LinkClosed, OSError)


def test_a_malformed_reply_ends_the_link(
    link: tuple[RelayLink, FakeRelay], caplog: pytest.LogCaptureFixture
) -> None:
    """A reply that does not decode stops the store process's reader: the call waiting for
    it, and every later one, fails with ``LinkClosed``."""
    worker, relay = link
    relay.raw = lambda rid: _reply({"type": "Committed", "retained": [7], "known": "yes"}, rid)
    with pytest.raises(LinkClosed, match="the relay is gone"):
        worker.commit(4, IMAGE, 1.0)
    with pytest.raises(LinkClosed, match="the relay is gone"):
        worker.job_finished(4, 3)
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(logged) == 1 and logged[0].startswith("store process: bad link packet"), logged
    assert "$.value.known" in logged[0], logged
    caplog.clear()  # expected
