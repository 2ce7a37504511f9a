"""The link between a relay and its store process: messages on a ``SOCK_SEQPACKET`` socketpair.

The relay serves checkpoint store connections in a process of its own (``storeworker``), niced,
so that a store session preempted while it holds the GIL stalls only other store sessions,
never the relay's loop that routes the ranks' messages (``docs/internals.md``, "Niceness"). The
relay (``storesupervisor``) starts it with one end of a socketpair (its fd number on the
command line) and sends it ``Init``; then, for each store connection whose preamble it read, a
``Conn`` with the connection's socket attached (``SCM_RIGHTS``). The store process serves it in
a thread of its own (``storethread``); what the session needs of the relay's state (the signing
key, the refusals of a put, the ``uploading`` set, the commit and its report, the image index)
it asks with a ``Call`` carrying a typed request, answered by a ``Reply`` of the same ``rid``
carrying a typed answer; ``Ended`` says a session is over. A packet is one message (msgpack),
so neither side ever reads half of one.

Every message is a tagged struct (its class name in ``type``), decoded by a typed decoder
(``to_worker``, ``from_worker``): a packet with an unknown tag, a missing or unknown field or
a field of the wrong type fails decoding as a whole (the side that reads it stops the link),
it never reaches the code that uses it.

Requests (``Call.request``) -> answers (``Reply.value``):

- ``SigningKeyAsk()`` -> ``SigningKey(raw)``: the raw Ed25519 public key, or None while the
  relay has none;
- ``BeginPut(job, rank, incarnation, ckpt)`` -> ``Granted()`` (the rank is ``uploading``) or
  ``Refusal(code, message)``;
- ``EndUpload(job, rank)`` -> ``Done()`` (the upload ended without a commit);
- ``JobFinished(job)`` -> ``JobState(finished)``;
- ``Commit(manifest, directory, wait)`` (the image is on disk) -> ``Committed(retained,
  known)``, ``known`` being ``report_outcome``'s answer, or ``Refusal(code, message)``;
- ``ImageAsk(job, rank, ckpt)`` -> ``Found(manifest, directory)`` or ``NotFound()``.

Any request may be answered ``NoAnswer(error)`` instead: its session is over, or the relay
could not answer (a bad request, or a bug); the session ends.
"""

from __future__ import annotations

import array
import socket

import msgspec

from vpool.protocol.errors import ErrorCode

# Largest link packet. A manifest names one counter per sending rank: a few bytes each.
MAX_PACKET = 4 * 1024 * 1024


class _Link(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """A message of the link (or a part of one): tagged with its class name."""


class Init(_Link):
    """What the store process needs of the relay's settings (the first packet)."""

    name: str
    data_dir: str
    handshake_timeout: float
    store_idle_timeout: float
    checkpoint_max_bytes: int
    store_report_wait: float
    bulk: bool
    tls_cert: str
    tls_key: str
    log_level: int


class Conn(_Link):
    """A store connection, its socket attached, preamble read."""

    cid: int
    peer: str


class Ended(_Link):
    """Session ``cid`` is over."""

    cid: int
    reason: str


# -- requests (store process -> relay) --------------------------------------------------------


class SigningKeyAsk(_Link):
    """The key tokens are verified with (waits ``handshake_timeout`` for it at most)."""


class BeginPut(_Link):
    """May image ``ckpt`` of ``incarnation`` of the rank be uploaded now? Granted, the rank is
    marked as uploading until ``Commit`` or ``EndUpload``."""

    job: int
    rank: int
    incarnation: int
    ckpt: int


class EndUpload(_Link):
    """The upload of the rank ended without a commit."""

    job: int
    rank: int


class JobFinished(_Link):
    """Is ``job`` over?"""

    job: int


class Commit(_Link):
    """The image of ``manifest`` (``Image.to_json``) is on disk in ``directory``: commit it,
    and wait (at most ``wait`` s) for the coordinator to know it."""

    manifest: bytes
    directory: str
    wait: float


class ImageAsk(_Link):
    """Image ``ckpt`` of the rank, from the relay's index."""

    job: int
    rank: int
    ckpt: int


Request = SigningKeyAsk | BeginPut | EndUpload | JobFinished | Commit | ImageAsk


# -- answers (relay -> store process) ---------------------------------------------------------


class SigningKey(_Link):
    raw: bytes | None  # None: the relay has no key (yet)


class Granted(_Link):
    pass


class Refusal(_Link):
    """Why a put or a commit is refused (what ``Refused`` says, but for job and rank)."""

    code: ErrorCode
    message: str


class Done(_Link):
    pass


class JobState(_Link):
    finished: bool


class Committed(_Link):
    retained: list[int]  # the image ids the relay keeps of the rank
    known: bool | None  # the coordinator accepted the image, refused it, or did not say in time


class Found(_Link):
    manifest: bytes
    directory: str


class NotFound(_Link):
    pass


class NoAnswer(_Link):
    """The relay has no answer: the session is over, or the request failed."""

    error: str


Answer = SigningKey | Granted | Refusal | Done | JobState | Committed | Found | NotFound | NoAnswer


# -- the packets --------------------------------------------------------------------------------


class Call(_Link):
    rid: int
    cid: int
    request: Request


class Reply(_Link):
    """The answer to the ``Call`` of the same ``rid``."""

    rid: int
    value: Answer


ToWorker = Init | Conn | Reply
FromWorker = Call | Ended

_encoder = msgspec.msgpack.Encoder()
to_worker = msgspec.msgpack.Decoder(ToWorker)
from_worker = msgspec.msgpack.Decoder(FromWorker)


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def fd_rights(fd: int) -> list[tuple[int, int, bytes]]:
    """The ancillary data that passes ``fd`` along with a packet."""
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]


def received_fds(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    """The fds a packet brought (they are open in this process now)."""
    fds = array.array("i")
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return list(fds)
