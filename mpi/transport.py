"""The rank's connection to its agent: one unix socket, frames of ``vpool.protocol.framing``.

Single-threaded and driven from MPI calls only. The socket stays in blocking mode; reads that
must not block pass ``MSG_DONTWAIT``, so waiting for a message is one ``recv_into`` system call.

Reading: frames land in a preallocated buffer with ``recv_into``. A small frame is handed to the
engine as a view of that buffer (the engine copies what it keeps). A large payload is read
straight into its destination: the user's buffer when a posted receive claims it at header time,
else a fresh bytearray that becomes the unexpected message's payload.

Writing: ``sendmsg`` of [prefix+header, *payload parts], no payload copy. When the socket is full
the writer polls for both directions and keeps reading incoming frames meanwhile, so two ranks
sending large messages to each other cannot deadlock.

Transport failures (agent gone, ``Stop``, ``Error``, malformed frames) end the process: an MPI
program cannot continue without its agent, and the agent reports the job's fate. Failures of
other ranks are the agent's ``Failed`` frames (jobs whose failure mode reports them), handed to
the engine (``Sink.on_failed``), as are its answers to spawns (``Spawned``, ``Sink.on_spawned``).
The arrays indexed by rank cover the job's rank numbers (``RankWelcome.size``: the ranks it
may spawn too).
"""

from __future__ import annotations

import os
import select
import socket
import sys
from typing import Any, Protocol

import msgspec

from vpool.protocol.errors import RemoteProtocolError
from vpool.protocol.framing import (
    DEFAULT_MAX_HEADER,
    LARGE,
    PREFIX,
    FrameScanner,
    Large,
    Small,
    decode_head,
)
from vpool.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    Ack,
    CheckpointRequest,
    Data,
    Det,
    DetAck,
    Error,
    Failed,
    Finalize,
    Message,
    RankHello,
    RankWelcome,
    Spawned,
    Stop,
    encode,
)

# Payloads above framing.LARGE are read straight into their destination, not the read buffer.
READ_BUFFER = 4 * LARGE + DEFAULT_MAX_HEADER
SOCKET_BUFFER = 4 * 1024 * 1024
MAX_IOV = 512  # below every platform's IOV_MAX
POKE_READS = 16
EXIT_TRANSPORT = 1

_FAILURES = b"\xa6failed"  # msgpack "failed": a Det holding observed failures may hold it
_pack_prefix = PREFIX.pack
_DONTWAIT = socket.MSG_DONTWAIT
# The same schema as ``messages.decode``, called directly: this is the per-message hot path.
_decode_header = msgspec.msgpack.Decoder(Message).decode


class Sink(Protocol):
    """What the transport hands incoming messages to (the p2p engine)."""

    def on_small(self, msg: Data, view: memoryview) -> None: ...

    def on_header(self, msg: Data, nbytes: int) -> tuple[memoryview, Any]: ...

    def on_payload(self, msg: Data, view: memoryview, token: Any) -> None: ...

    def on_failed(self, ranks: list[int]) -> None: ...

    def on_spawned(self, msg: Spawned) -> None: ...

    def load_cuts(self, records: Any) -> None: ...


def die(text: str, code: int = EXIT_TRANSPORT) -> None:
    """Leave now: flush what the program printed, say why on stderr, skip atexit handlers."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    try:
        os.write(2, f"vpool: {text}\n".encode())
    except OSError:
        pass
    os._exit(code)


class Transport:
    def __init__(self, sock: socket.socket, welcome: RankWelcome, sink: Sink) -> None:
        self.sock = sock
        self.job = welcome.job
        self.rank = welcome.rank
        self.size = welcome.size
        self.incarnation = welcome.incarnation
        self.processor = welcome.processor
        self.sink = sink
        self.welcome = welcome  # what the agent said at connection (``environment.init``)
        # seq(s, d) of the last message sent to each destination, and the highest acked: one
        # per rank number of the job (``size``: the ranks it may spawn too).
        self.sent = [0] * self.size
        self.acked = [0] * self.size
        # Per source, the highest seq of a complete Data frame taken off the socket (a
        # checkpoint's ``received``: where the relay resumes pushing for a restored image).
        self.received = [0] * self.size
        # The request of a CheckpointRequest read and not acted on yet (``checkpoint``).
        self.ckpt_request: int | None = None
        self._scanner = FrameScanner(buffer_size=READ_BUFFER, large=LARGE)
        # A large payload being read into its target: (its Data header, the sink's token).
        self._large: tuple[Data, Any] | None = None
        self._poll = select.poll()
        self._fd = sock.fileno()
        self._poll.register(self._fd, select.POLLIN)
        self.closed = False
        # Determinants (``ft``): written, acknowledged, and the ack count a deposit may go out
        # at (``det_need == det_acked``: the one comparison of the fast path).
        self.ft: Any = None
        self.det_sent = 0
        self.det_acked = 0
        self.det_need = 0
        self.replay_dets = welcome.replay_dets
        self.replay_sent = welcome.replay_sent
        self.on_failure = welcome.on_failure  # the job's failure mode (``runtime.Engine.eager``)

    # ---- opening -------------------------------------------------------------------------

    @classmethod
    def connect(cls, path: str, secret: str, sink: Sink) -> Transport:
        sock, welcome = open_connection(path, RankHello(version=PROTOCOL_VERSION, secret=secret))
        return cls(sock, welcome, sink)

    def reopen(self, sock: socket.socket, welcome: RankWelcome) -> None:
        """Carry on over a new connection (a process restored from a checkpoint): the read
        state starts afresh, what the image had read stays read (``received``)."""
        self.sock = sock
        self._fd = sock.fileno()
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)
        self._scanner = FrameScanner(buffer_size=READ_BUFFER, large=LARGE)
        self._large = None
        self.closed = False
        self.incarnation = welcome.incarnation
        self.processor = welcome.processor
        self.replay_dets = welcome.replay_dets
        self.replay_sent = welcome.replay_sent
        self.on_failure = welcome.on_failure

    # ---- writing -------------------------------------------------------------------------

    def send_data(
        self, dst: int, ctx: int, tag: int, kind: int, parts: list[int], bufs: list[Any], n: int
    ) -> None:
        """Deposit one message; returns once every byte is handed to the socket."""
        if self.det_need != self.det_acked:
            self.ft.before_data()  # pessimistic rule: every determinant acked first
        seq = self.sent[dst] + 1
        self.sent[dst] = seq
        header = encode(Data(self.job, self.rank, dst, seq, ctx, tag, kind, parts))
        head = _pack_prefix(len(header), n) + header
        if not n:
            self._write([head], len(head))
        elif len(bufs) == 1:
            self._write([head, bufs[0]], len(head) + n)
        else:
            self._write([head, *bufs], len(head) + n)

    def send_det(self, index: int, data: bytes) -> None:
        self.send_message(Det(self.job, self.rank, index, data))
        self.det_sent += 1

    def wait_det_acks(self) -> None:
        """Wait until every determinant written is acknowledged, handling what arrives."""
        while self.det_acked < self.det_sent:
            self._read(0)

    def wait_dets(self, n: int) -> None:
        """Read until the ``n`` determinants of a replay are in (``Data`` goes to the engine)."""
        while self.ft.loaded < n:
            self._read(0)

    def send_message(self, msg: Message) -> None:
        header = encode(msg)
        head = _pack_prefix(len(header), 0) + header
        self._write([head], len(head))

    def _write(self, parts: list[Any], total: int) -> None:
        if len(parts) <= MAX_IOV:
            try:
                sent = self.sock.sendmsg(parts, (), _DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                die(f"lost the connection to the agent: {exc}")
            if sent == total:
                return
        else:
            sent = 0
        self._write_slow(parts, sent)

    def _write_slow(self, parts: list[Any], sent: int) -> None:
        views = [memoryview(p) for p in parts]
        views = [v if v.format == "B" and v.ndim == 1 else v.cast("B") for v in views]
        i = _consumed(views, 0, sent)
        poll = self._poll
        fd = self._fd
        poll.modify(fd, select.POLLIN | select.POLLOUT)
        try:
            while i < len(views):
                events = 0
                for _, ev in poll.poll():
                    events |= ev
                if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                    # Keep draining incoming frames so a peer writing to us can progress.
                    self._read(_DONTWAIT)
                if not events & select.POLLOUT:
                    continue
                try:
                    n = self.sock.sendmsg(views[i : i + MAX_IOV], (), _DONTWAIT)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    die(f"lost the connection to the agent: {exc}")
                i = _consumed(views, i, n)
                while i < len(views) and views[i].nbytes == 0:
                    i += 1
        finally:
            poll.modify(fd, select.POLLIN)

    # ---- reading -------------------------------------------------------------------------

    def progress(self, block: bool) -> None:
        """Read what has arrived; with ``block``, wait until at least one byte does."""
        if block:
            self._read(0)
        else:
            # Bounded: a Test() loop must return even while a peer streams at full speed.
            for _ in range(POKE_READS):
                if not self._read(_DONTWAIT):
                    break

    @property
    def mid_payload(self) -> bool:
        """A large payload is being read into its destination."""
        return self._large is not None

    def _read(self, flags: int) -> bool:
        """One ``recv_into`` and the frames it completes; False when nothing was there."""
        scanner = self._scanner
        try:
            n = self.sock.recv_into(scanner.get_buffer(), 0, flags)
        except BlockingIOError:
            return False
        except InterruptedError:
            return True
        except OSError as exc:
            die(f"lost the connection to the agent: {exc}")
        if n == 0:
            die("the agent closed the connection")
        scanner.buffer_updated(n)
        self._parse()
        return True

    def _parse(self) -> None:
        scanner = self._scanner
        sink = self.sink
        received = self.received
        while True:
            try:
                event = scanner.next_event()
            except RemoteProtocolError as exc:
                die(f"malformed frame from the agent: {exc}")
            if event is None:
                return
            if type(event) is Small:
                frame = event.frame
                body = 8 + event.header_len
                msg = self._decode(frame[8:body])
                if type(msg) is Data:
                    received[msg.src] = msg.seq
                    sink.on_small(msg, frame[body:])
                elif event.payload_len:
                    die(f"{type(msg).__name__} frame with a payload from the agent")
                else:
                    self._control(msg)
            elif type(event) is Large:
                msg = self._decode(event.head[8:])
                if type(msg) is not Data:
                    die(f"{type(msg).__name__} frame with a payload from the agent")
                target, token = sink.on_header(msg, event.payload_len)
                scanner.claim(target)
                self._large = (msg, token)
            else:
                large = self._large
                assert large is not None
                self._large = None
                received[large[0].src] = large[0].seq
                sink.on_payload(large[0], event.target, large[1])

    @staticmethod
    def _decode(raw: memoryview) -> Message:
        try:
            return _decode_header(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            die(f"malformed frame from the agent: {exc}")
            raise  # unreachable: die() exits

    def _control(self, msg: Message) -> None:
        if type(msg) is Ack:
            if msg.src == self.rank and 0 <= msg.dst < self.size and msg.seq > self.acked[msg.dst]:
                self.acked[msg.dst] = msg.seq
        elif type(msg) is DetAck:
            if msg.count > self.det_acked:
                self.det_acked = msg.count
        elif type(msg) is Det:
            if self.ft is None or msg.index < self.ft.loaded:
                return  # a determinant this rank already has
            self.ft.load(msg.index, msg.data)
            if _FAILURES in msg.data:
                # Failures a transparent job's rank observed (``Engine.observe``): what it
                # dropped of their messages is dropped from the start of the replay.
                self.sink.load_cuts(msgspec.msgpack.decode(msg.data))
        elif type(msg) is CheckpointRequest:
            self.ckpt_request = msg.request  # acted on by the engine, never in here
        elif type(msg) is Failed:
            self.sink.on_failed(msg.ranks)  # ULFM: failures reported to the program
        elif type(msg) is Spawned:
            self.sink.on_spawned(msg)  # the answer to a SpawnRequest (``spawn``)
        elif type(msg) is Stop:
            die(f"stopped: {msg.reason}")
        elif type(msg) is Error:
            die(f"error from the agent: {msg.code}: {msg.message}")
        else:
            die(f"unexpected {type(msg).__name__} from the agent")

    # ---- ending --------------------------------------------------------------------------

    def all_acked(self) -> bool:
        return self.sent == self.acked

    def finalize(self) -> None:
        """Wait until every deposit is acknowledged, then say so to the agent."""
        while self.sent != self.acked:
            self._read(0)
        self.send_message(Finalize())
        self.closed = True

    def abort(self, code: int, message: str) -> None:
        self.send_message(Abort(code=code, message=message))


def _consumed(views: list[memoryview], i: int, n: int) -> int:
    """``n`` more bytes of ``views[i:]`` were written: the index of the first view not
    written in full, which is cut to what is left of it."""
    while n:
        size = views[i].nbytes
        if n >= size:
            n -= size
            i += 1
        else:
            views[i] = views[i][n:]
            n = 0
    return i


def open_connection(path: str, hello: RankHello) -> tuple[socket.socket, RankWelcome]:
    """Connect to the agent's socket, say ``hello``, read the ``RankWelcome`` (blocking)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if not hello.control:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        except OSError:
            pass  # a smaller buffer only costs throughput
    try:
        sock.connect(path)
    except OSError as exc:
        die(f"cannot connect to the agent at {path}: {exc}")
    header = encode(hello)
    sock.sendall(_pack_prefix(len(header), 0) + header)
    return sock, _read_welcome(sock)


def read_message(sock: socket.socket) -> Message:
    """One header-only frame from a blocking socket (the welcome, the checkpoint control
    connection), read exactly: the frames that follow belong to the transport's scanner."""
    scanner = FrameScanner(max_payload=0)
    try:
        while (event := scanner.next_event()) is None:
            view = scanner.get_buffer()[: scanner.needed()]
            try:
                n = sock.recv_into(view)
            except OSError as exc:
                die(f"lost the connection to the agent: {exc}")
            if not n:
                die("the agent closed the connection")
            scanner.buffer_updated(n)
        assert type(event) is Small
        return decode_head(event.frame, event.header_len, event.payload_len)
    except RemoteProtocolError as exc:
        die(f"malformed frame from the agent: {exc}")
        raise


def write_message(sock: socket.socket, msg: Message) -> None:
    header = encode(msg)
    try:
        sock.sendall(_pack_prefix(len(header), 0) + header)
    except OSError as exc:
        die(f"lost the connection to the agent: {exc}")


def _read_welcome(sock: socket.socket) -> RankWelcome:
    msg = read_message(sock)
    if isinstance(msg, Error):
        die(f"the agent refused this rank: {msg.code}: {msg.message}")
    if not isinstance(msg, RankWelcome):
        die(f"expected RankWelcome from the agent, got {type(msg).__name__}")
    return msg
