"""Typed messages of the data path: rank <-> agent (unix socket) and agent <-> relay (TCP+TLS).

Every message is a msgspec Struct in one tagged union (``Message``), encoded as MessagePack arrays
(``array_like``: compact, and new trailing fields with defaults stay compatible). A frame carries
one message header and, for ``Data``, raw payload bytes after it (see ``framing``).

The same ``Data`` header travels unchanged on every hop: the sending rank encodes it once, its
agent and the relay forward the header bytes verbatim, and the receiving rank decodes it. Relays
store whole frames in their logs and push them back out as they were deposited.

Hops and who sends what::

    rank -> agent:   RankHello, Data, Det, Abort, Finalize
    agent -> rank:   RankWelcome, Data, Det, Ack, DetAck, Error, Stop, CheckpointRequest
    agent -> relay:  Hello, Attach, Data, Det, Credit, Delivered, Detach, Ping, Pong
    relay -> agent:  Welcome, Attached, Data, Det, Ack, DetAck, Error, Stop, Ping, Pong

Checkpoints (docs/internals.md, "Checkpoints"): a rank's second unix connection, opened with
``RankHello(control=True)``, carries ``CkptForked`` (rank -> agent). A relay's checkpoint
store is reached on its own connection: the plaintext preamble ``VPSTORE\x01``, then TLS,
then ``Hello(role="store")``::

    agent -> store:  CkptPut, CkptChunk (payload), CkptEnd, CkptGet
    store -> agent:  CkptStored, CkptInfo, CkptChunk (payload), CkptEnd, Error

Fault tolerance (docs/internals.md, "Fault tolerance"): ``Det`` carries one determinant (a
non-deterministic outcome of a rank) to the rank's home relay, which logs it and answers
``DetAck``; on a restart the relay pushes the logged ``Det``s back, before any ``Data``.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

# 2: an image's digest is its skeleton's, and puts carry a transport MAC (``ckptdigest``).
PROTOCOL_VERSION: Final = 2

# Data.kind: how the payload is to be read by the receiving runtime.
KIND_BUFFER: Final = 0  # raw bytes of a typed buffer (upper-case Send/Recv)
KIND_PICKLE: Final = 1  # pickle protocol 5; ``parts`` gives the lengths of out-of-band buffers


# An image's id (its wall-clock time in ms): never negative, so nothing on the wire can pose
# as the store's "no image" (-1).
ImageId = Annotated[int, msgspec.Meta(ge=0)]


class _Msg(msgspec.Struct, array_like=True, frozen=True, tag_field="type"):
    pass


class Hello(_Msg, frozen=True, tag="hello"):
    """Opens every agent -> relay connection. ``token`` is the agent token signed by the
    coordinator. ``pings``: this agent sends ``Ping`` on a quiet connection, so the relay may
    close one that stays silent (an older agent says nothing and is never closed for it)."""

    version: int
    role: str
    token: str = ""
    software: str = ""
    pings: bool = False


class Welcome(_Msg, frozen=True, tag="welcome"):
    """Relay's answer to a good ``Hello``. ``push_window`` is the relay's push window per
    receiving rank (0 = not said): an agent may then gather ``Credit`` up to a quarter of it
    instead of crediting every write."""

    version: int
    relay: str = ""
    max_payload: int = 0
    push_window: int = 0
    # Store connections: the store reads the payloads of a put with ``CkptPut.bulk`` from the
    # TCP stream beneath TLS (``relay.ckptstore``, "Bulk payloads").
    bulk: bool = False
    # The relay answers ``Ping`` (an older one would take it for a malformed frame).
    pings: bool = False


class Error(_Msg, frozen=True, tag="error"):
    """A typed error: ``code`` is machine-readable, ``message`` is for people.

    ``job``/``rank`` name the rank concerned when the error is about one rank on a
    multiplexed connection; -1 when it concerns the whole connection (which is then closed)."""

    code: str
    message: str
    job: int = -1
    rank: int = -1


class Attach(_Msg, frozen=True, tag="attach"):
    """Agent -> relay: bind rank (named by its signed rank token) to this connection.

    With ``home`` the relay pushes the rank's incoming messages on this connection, resuming
    after ``received``: for every source rank, the highest seq the rank already has; before them
    it pushes the rank's logged determinants with ``index >= dets_from``. Without ``home`` the
    rank only deposits messages through this connection.
    """

    token: str
    home: bool = False
    received: dict[int, int] = {}
    dets_from: int = 0


class Attached(_Msg, frozen=True, tag="attached"):
    """Relay -> agent: the rank is attached. ``stored`` gives, per destination rank homed at
    this relay, the highest seq from this rank already in the log (so a reconnecting sender
    knows what it need not resend). ``dets`` (home attachments only): how many determinants of
    this rank the log holds; those with index >= ``Attach.dets_from`` follow as ``Det`` frames,
    before any pushed ``Data``."""

    job: int
    rank: int
    incarnation: int
    stored: dict[int, int] = {}
    dets: int = 0


class Detach(_Msg, frozen=True, tag="detach"):
    """Agent -> relay: the rank is done with this connection (clean end, not a failure)."""

    job: int
    rank: int


class Data(_Msg, frozen=True, tag="data"):
    """One MPI message from ``src`` to ``dst`` of ``job``, seq-numbered per channel (src, dst).

    ``ctx`` is the communicator context id, ``tag`` the MPI tag, ``kind`` how to read the
    payload (``KIND_*``), ``parts`` the lengths of the payload's parts for pickled messages
    (first the pickle stream, then each out-of-band buffer). The payload follows raw, or
    (``sealed``: between agents and relays) encrypted with the job's message key, 16 bytes
    longer (``protocol.sealing``); ranks only ever see plaintext.
    """

    job: int
    src: int
    dst: int
    seq: int
    ctx: int
    tag: int
    kind: int = KIND_BUFFER
    parts: list[int] = []
    sealed: bool = False


class Ack(_Msg, frozen=True, tag="ack"):
    """Relay -> agent -> rank: every message of channel (src, dst) with seq <= ``seq`` is in
    dst's log (cumulative)."""

    job: int
    src: int
    dst: int
    seq: int


class Det(_Msg, frozen=True, tag="det"):
    """One determinant of (job, rank): the ``index``-th (0, 1, 2, ...) non-deterministic outcome
    the rank's runtime logged. ``data`` is opaque to agents and relays (the runtime's own
    encoding, ``vpool.protocol.rank_ft``). Rank -> agent -> home relay to log it; home relay ->
    agent -> rank to replay it after a restart. Header only, never a payload."""

    job: int
    rank: int
    index: int
    data: bytes


class DetAck(_Msg, frozen=True, tag="det_ack"):
    """Home relay -> agent -> rank: determinants ``0 .. count-1`` of (job, rank) are durable in
    the log (cumulative). Sent as soon as they are, never delayed like ``Ack``: the rank's
    next deposit waits for it (the pessimistic rule)."""

    job: int
    rank: int
    count: int


class Credit(_Msg, frozen=True, tag="credit"):
    """Agent -> relay: ``nbytes`` of frames pushed for (job, rank) have been handed to the rank;
    the relay may push that much more (flow control)."""

    job: int
    rank: int
    nbytes: int


class Delivered(_Msg, frozen=True, tag="delivered"):
    """Agent -> relay: incarnation ``incarnation`` of rank (job, ``rank``), home-attached on this
    connection, has every message of channel (``src``, rank) up to ``seq``: its agent handed
    them over itself (agent-local delivery, the sender being a rank of the same agent). The
    relay still logs them (the sender deposits them as always) but pushes none of them to
    this attachment. Sent right after the ``Data`` it is about; a relay drops one that names
    another incarnation or an attachment elsewhere (docs/internals.md, "Agent-local
    delivery")."""

    job: int
    rank: int
    incarnation: int
    src: int
    seq: int


class Stop(_Msg, frozen=True, tag="stop"):
    """Tells the receiver that (job, rank, incarnation) must stop: fenced, cancelled or failed."""

    job: int
    rank: int
    incarnation: int
    reason: str


class Ping(_Msg, frozen=True, tag="ping"):
    """Either way on an open agent <-> relay connection: are you there? The receiver answers
    ``Pong`` with the same ``nonce`` at once. Sent by a side that has received nothing for a
    while (``protocol.liveness``); any frame that arrives shows the peer alive, the ``Pong``
    only guarantees one does."""

    nonce: int


class Pong(_Msg, frozen=True, tag="pong"):
    """The answer to ``Ping``, echoing its ``nonce``."""

    nonce: int


class RankHello(_Msg, frozen=True, tag="rank_hello"):
    """Rank -> agent, first frame on the unix socket. ``secret`` is the per-lease secret the
    agent put in the rank's environment. ``control``: this is the rank's checkpoint control
    connection, not its data connection. ``checkpoint``: the id of the image this process was
    restored from (-1: a process started from the beginning). ``orphan``: a checkpoint clone
    whose rank died before the agent knew of it; it sends its own ``CkptForked`` on this
    connection and closes it (the agent may still dump it for the rank's replacement)."""

    version: int
    secret: str
    control: bool = False
    checkpoint: int = -1
    orphan: bool = False


class RankWelcome(_Msg, frozen=True, tag="rank_welcome"):
    """Agent -> rank: who the rank is."""

    job: int
    rank: int
    size: int
    incarnation: int
    processor: str = ""
    replay_dets: int = 0  # determinants that follow as Det frames before anything else
    # A replaying rank: per destination, the highest seq from this rank the relays already hold
    # (``Attached.stored``). Until it has re-sent that much, the runtime performs asynchronous
    # sends only as its determinants say (``vpool.protocol.rank_ft``).
    replay_sent: dict[int, int] = {}
    # The job's failure mode (``vsdk submit --on-failure``): "transparent" (a lost rank is
    # restarted and replays; the program never sees a failure), "abort", "ulfm", "blank",
    # "shrink" or "rebuild" (failures are reported to the program, ``Failed`` frames).
    on_failure: str = "transparent"
    # Spawned processes (``api.Lease``): ``size`` is the job's universe; ``world`` the job ranks
    # of this process's COMM_WORLD (empty: 0 to size - 1); ``parent`` and ``parent_ctx`` the
    # spawning group and the context of the intercommunicator to it (empty: not spawned).
    world: list[int] = []
    parent: list[int] = []
    parent_ctx: int = 0
    universe: int = 0  # MPI.UNIVERSE_SIZE (0: ``size``)


class CheckpointRequest(_Msg, frozen=True, tag="ckpt_request"):
    """Agent -> rank (data connection): take checkpoint ``request`` (its id: increasing per
    rank) at the next safe point. The agent also sends the rank the checkpoint signal
    (``VPOOL_CKPT_SIGNAL``) for a rank that computes without calling MPI, and reads none of the
    rank's output until ``CkptForked`` (so the output offsets of the image are exact)."""

    request: int


class CkptForked(_Msg, frozen=True, tag="ckpt_forked"):
    """Rank -> agent (control connection): the clone of checkpoint ``ckpt`` is process ``pid``
    (-1: the fork failed, ``message`` says why). The counters at the fork: ``received[s]`` the
    highest seq from source s taken off the socket, ``sent[d]`` the highest seq sent to d,
    ``dets`` the Det frames written (all of them: nothing pending); ``pending`` the bytes of
    stdout and stderr still in their pipes (written, flushed, not read by the agent yet);
    ``pause_us`` how long the rank stood still for it (flushes and the fork, wall clock: on a
    busy machine this includes waiting for a CPU), ``pause_cpu_us`` the CPU time it spent on it.
    ``orphan``: sent by the clone itself (``RankHello.orphan``): the rank died before it could
    say it forked, and the pauses are unknown (0)."""

    ckpt: int
    pid: int
    received: list[int] = []
    sent: list[int] = []
    dets: int = 0
    pending: list[int] = []
    pause_us: int = 0
    message: str = ""
    pause_cpu_us: int = 0
    orphan: bool = False


class CkptPut(_Msg, frozen=True, tag="ckpt_put"):
    """Agent -> store: an image of (job, rank) follows as ``CkptChunk`` frames, then ``CkptEnd``.
    ``token`` is the rank token of the incarnation that made it. ``received``/``dets`` are its
    counters (what the home relay may drop once it is committed); ``fingerprint`` the agent's
    environment fingerprint; ``meta`` the agent's manifest (opaque to the store). ``bulk``
    (only to a store whose ``Welcome`` said ``bulk``): each ``CkptChunk`` payload of this image
    follows its TLS-borne prefix and header on the TCP stream beneath TLS. ``mac_key``: a
    one-time Poly1305 key (32 bytes, drawn for this put alone) under which ``CkptEnd.mac``
    covers every payload byte of the image (``protocol.ckptdigest``)."""

    token: str
    ckpt: ImageId
    received: dict[int, int]
    dets: int
    fingerprint: str
    meta: bytes = b""
    bulk: bool = False
    mac_key: bytes = b""


class CkptChunk(_Msg, frozen=True, tag="ckpt_chunk"):
    """Either way: the next bytes of image ``ckpt`` (ciphertext) as the frame's payload."""

    ckpt: ImageId


class CkptEnd(_Msg, frozen=True, tag="ckpt_end"):
    """Either way: image ``ckpt`` is complete: ``size`` bytes whose digest
    (``protocol.ckptdigest.ImageDigest``) is ``digest``; after a put, ``mac`` is the Poly1305
    tag of the image's bytes under the put's ``mac_key`` (empty after a get)."""

    ckpt: ImageId
    size: int
    digest: bytes
    mac: bytes = b""


class CkptStored(_Msg, frozen=True, tag="ckpt_stored"):
    """Store -> agent: image ``ckpt`` is durable and committed; ``retained`` lists the images of
    this rank the store keeps (newest first)."""

    ckpt: int
    retained: list[int]


class CkptGet(_Msg, frozen=True, tag="ckpt_get"):
    """Agent -> store: send image ``ckpt`` of the rank named by ``token`` (the restoring
    incarnation's rank token)."""

    token: str
    ckpt: ImageId


class CkptInfo(_Msg, frozen=True, tag="ckpt_info"):
    """Store -> agent: image ``ckpt`` follows (``CkptChunk``s, then ``CkptEnd``): ``size`` bytes
    whose digest (``protocol.ckptdigest``) is ``digest``."""

    ckpt: int
    size: int
    digest: bytes
    received: dict[int, int]
    dets: int
    fingerprint: str
    meta: bytes = b""


class Abort(_Msg, frozen=True, tag="abort"):
    """Rank -> agent: ``MPI.Abort(code)``: end the whole job with this exit code."""

    code: int
    message: str = ""


class Failed(_Msg, frozen=True, tag="failed"):
    """Agent -> rank (data connection), in a job whose failure mode reports failures
    (``api.REPORTING_MODES``) or that has reported spawns: ``ranks`` are the world ranks of the
    job the coordinator has declared failed so far (a growing set: each frame repeats the
    earlier ones). A failed rank is fenced at the relays before any survivor hears of it, so
    nothing it sends afterwards reaches anybody: it never comes back."""

    ranks: list[int]


class SpawnRequest(_Msg, frozen=True, tag="spawn"):
    """Rank -> agent: this rank is the root of an ``MPI.Comm.Spawn`` (``api.SpawnAsk``, whose
    fields these are); the agent answers ``Spawned`` with the same ``seq``."""

    seq: int
    command: list[str]
    maxprocs: int
    least: int
    parent: list[int]
    ctx: int
    reported: bool = False


class Spawned(_Msg, frozen=True, tag="spawned"):
    """Agent -> rank: the answer to ``SpawnRequest`` ``seq`` (``api.SpawnAnswer``)."""

    seq: int
    ranks: list[int]
    error: str = ""


class Finalize(_Msg, frozen=True, tag="finalize"):
    """Rank -> agent: the rank has called ``MPI.Finalize`` after all its deposits were acked."""


Message = (
    Hello
    | Welcome
    | Error
    | Attach
    | Attached
    | Detach
    | Data
    | Det
    | DetAck
    | Ack
    | Credit
    | Delivered
    | Stop
    | Ping
    | Pong
    | RankHello
    | RankWelcome
    | Abort
    | Finalize
    | Failed
    | SpawnRequest
    | Spawned
    | CheckpointRequest
    | CkptForked
    | CkptPut
    | CkptChunk
    | CkptEnd
    | CkptStored
    | CkptGet
    | CkptInfo
)

_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """MessagePack bytes of one message header."""
    return _encoder.encode(msg)


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Decode one message header; raise ``RemoteProtocolError`` on anything malformed."""
    from vpool.protocol.errors import RemoteProtocolError

    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        # ValueError covers UnicodeDecodeError: msgspec raises it for invalid UTF-8 in a str.
        raise RemoteProtocolError(f"malformed message header: {exc}") from exc
