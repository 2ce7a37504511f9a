"""The link between a relay and its store process: messages on a ``SOCK_SEQPACKET`` socketpair.

The relay serves checkpoint store connections in a process of its own (``storeworker``), niced,
so that a store session preempted while it holds the GIL stalls only other store sessions,
never the relay's loop that routes the ranks' messages (``docs/internals.md``, "Niceness"). The
relay (``storesupervisor``) starts it with one end of a socketpair (its fd number on the
command line) and sends it ``Init``; then, for each store connection whose preamble it read, a
``Conn`` with the connection's socket attached (``SCM_RIGHTS``). The store process serves it in
a thread of its own (``storethread``); what the session needs of the relay's state (the signing
key, the refusals of a put, the ``uploading`` set, the commit and its report, the image index)
it asks with a ``Call``, answered by a ``Reply`` of the same ``rid``; ``Ended`` says a session
is over. A packet is one message (msgpack), so neither side ever reads half of one.

Calls (``op``, ``args`` -> ``Reply.value``):

- ``signing_key``: () -> the raw Ed25519 public key, or None while the relay has none;
- ``begin_put``: (job, rank, incarnation, ckpt) -> None, or a refusal [code, message];
- ``end_upload``: (job, rank) -> None (the upload ended without a commit);
- ``job_finished``: (job,) -> bool;
- ``commit``: (manifest, directory, wait) -> [refusal or None, retained ids, known]: the
  image is on disk; ``known`` is ``report_outcome``'s answer (None when refused);
- ``image``: (job, rank, ckpt) -> [manifest, directory], or None.
"""

from __future__ import annotations

import array
import socket
from typing import Any

import msgspec

# Largest link packet. A manifest names one counter per sending rank: a few bytes each.
MAX_PACKET = 4 * 1024 * 1024


class Init(msgspec.Struct, tag=True):
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


class Conn(msgspec.Struct, tag=True):
    """A store connection, its socket attached, preamble read."""

    cid: int
    peer: str


class Reply(msgspec.Struct, tag=True):
    """The answer to a ``Call``; ``error`` set: there is none (the session is over)."""

    rid: int
    value: Any = None
    error: str = ""


class Call(msgspec.Struct, tag=True):
    rid: int
    cid: int
    op: str
    args: list[Any]


class Ended(msgspec.Struct, tag=True):
    cid: int
    reason: str


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
