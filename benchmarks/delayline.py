"""A user-space TCP delay line, and a plain TCP stream measured through it.

    .venv/bin/python benchmarks/delayline.py [--delay MS] [--bytes N] [--rate MIBPS]
    .venv/bin/python benchmarks/delayline.py --forward HOST:PORT [--listen PORT] [--delay MS]

This kernel has no netem, so a wide-area link is emulated in user space: ``DelayLine`` listens on
127.0.0.1 (port 0 by default), and for each connection it accepts opens one to its target and
forwards both directions, each chunk it read written out ``delay`` seconds after it was read.
Every direction is a timestamped queue between a reader thread and a writer thread, so the line
keeps its bandwidth: the reader never waits for the delay, only for room in the queue
(``max_queue`` bytes, the line's buffer: when it is full the reader stops reading and TCP pushes
back on the sender). With ``rate`` (bytes/s) the line also has a bottleneck: each chunk leaves
the sending end when the link is free and arrives ``delay`` later, and the buffer is by default
twice rate x delay.

The bytes that travel through the line never wait for a kernel's TCP window across the delay:
on both sides the hop to the line is loopback. A plain TCP stream through the line therefore
measures what the line carries (``measure_plain``), and an application whose own flow control
needs round trips (vpool's push window and its ``Credit``s) shows what that flow control costs
on such a link.

Used as a library by benchmarks/wan_stream.py, and by benchmarks/wan_netns.py's line process
(on a relay's namespace machine, listening on its address: ``host``)::

    with DelayLine(("127.0.0.1", port), delay=0.020) as line:
        connect_to(line.port)

The target may be a callable returning (host, port), called at each accepted connection, so a
line can listen before what it forwards to has started. Without ``--forward`` the script
measures a plain TCP stream through a line of each given delay (the source and the sink run in
a child process, the line in this one, as a pool's processes are when benchmarks/wan_stream.py
puts lines in front of its relays).
"""

from __future__ import annotations

import argparse
import collections
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

MiB = 1024 * 1024
CHUNK = 256 * 1024  # bytes read at once
MAX_QUEUE = 64 * MiB  # bytes one direction holds before it stops reading
JOIN_TIMEOUT = 5.0

Address = tuple[str, int]
Target = Address | Callable[[], Address]


class _Direction:
    """One direction of one connection: a reader thread queues (due, chunk); a writer thread
    sends each chunk once it is due. An empty chunk is the end of the stream."""

    def __init__(self, line: DelayLine, src: socket.socket, dst: socket.socket, name: str):
        self.line = line
        self.src = src
        self.dst = dst
        self.name = name
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.queued = 0
        self.cond = threading.Condition()
        self.free_at = 0.0  # when the emulated link can start sending the next chunk (rate)
        self.forwarded = 0
        self.threads = [
            threading.Thread(target=self._read, name=f"{name}-read", daemon=True),
            threading.Thread(target=self._write, name=f"{name}-write", daemon=True),
        ]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def _due(self, now: float, size: int) -> float:
        line = self.line
        if line.rate is None:
            return now + line.delay
        self.free_at = max(self.free_at, now) + size / line.rate
        return self.free_at + line.delay

    def _read(self) -> None:
        line, cond = self.line, self.cond
        while True:
            try:
                chunk = self.src.recv(line.chunk)
            except OSError:
                chunk = b""
            with cond:
                while chunk and self.queued >= line.max_queue and not line.closed:
                    cond.wait()
                if line.closed:
                    return
                self.queue.append((self._due(time.monotonic(), len(chunk)), chunk))
                self.queued += len(chunk)
                cond.notify_all()
            if not chunk:
                return

    def _write(self) -> None:
        line, cond, queue = self.line, self.cond, self.queue
        while True:
            with cond:
                while True:
                    if line.closed:
                        return
                    if queue:
                        wait = queue[0][0] - time.monotonic()
                        if wait <= 0:
                            break
                        cond.wait(wait)
                    else:
                        cond.wait()
                # Everything already due leaves in one go (up to a few chunks).
                parts: list[bytes] = []
                size = 0
                now = time.monotonic()
                while queue and queue[0][0] <= now and queue[0][1] and size < 4 * line.chunk:
                    chunk = queue.popleft()[1]
                    parts.append(chunk)
                    size += len(chunk)
                end = not parts and bool(queue) and not queue[0][1]
                self.queued -= size
                cond.notify_all()
            try:
                if end:
                    self.dst.shutdown(socket.SHUT_WR)
                    return
                for chunk in parts:
                    self.dst.sendall(chunk)
                self.forwarded += size
            except OSError:
                line.drop(self.src, self.dst)
                return


class DelayLine:
    """A TCP forwarder adding ``delay`` seconds each way (see the module docstring)."""

    def __init__(
        self,
        target: Target,
        delay: float,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        rate: float | None = None,
        max_queue: int | None = None,
        chunk: int = CHUNK,
    ) -> None:
        if delay < 0 or (rate is not None and rate <= 0):
            raise ValueError("delay must be >= 0 and rate > 0")
        self.target = target
        self.delay = delay
        self.rate = rate
        if max_queue is None:
            # A bottleneck gets a router's buffer: what is on the way (rate x delay) and as
            # much again waiting for the link; a bigger one only adds queueing delay.
            max_queue = MAX_QUEUE if rate is None else max(4 * chunk, int(2 * rate * delay))
        self.max_queue = max_queue
        self.chunk = chunk
        self.closed = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._directions: list[_Direction] = []
        self._listener = socket.create_server((host, port))
        self.host, self.port = self._listener.getsockname()[:2]
        self._acceptor = threading.Thread(target=self._accept, name="delayline-accept", daemon=True)
        self._acceptor.start()

    def __enter__(self) -> DelayLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def forwarded(self) -> int:
        """Bytes written out so far, both directions, every connection."""
        return sum(d.forwarded for d in self._directions)

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                target = self.target() if callable(self.target) else self.target
                server = socket.create_connection(target)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            pair = [
                _Direction(self, client, server, f"delayline-{self.port}-up"),
                _Direction(self, server, client, f"delayline-{self.port}-down"),
            ]
            with self._lock:
                if self.closed:
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
                self._directions += pair
            for d in pair:
                d.start()

    def drop(self, *socks: socket.socket) -> None:
        """A connection broke: end both of its sockets (the other direction's threads see it)."""
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            socks = list(self._sockets)
            directions = list(self._directions)
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept (Linux)
        except OSError:
            pass
        self._listener.close()
        self.drop(*socks)
        for d in directions:
            with d.cond:
                d.cond.notify_all()
        deadline = time.monotonic() + JOIN_TIMEOUT
        for t in [self._acceptor, *(t for d in directions for t in d.threads)]:
            t.join(max(0.0, deadline - time.monotonic()))
        for s in socks:
            s.close()


# -- a plain TCP stream through a line --------------------------------------------------------


def _endpoints(line_port: int, nbytes: int, chunk: int) -> None:
    """Child process: a sink on 127.0.0.1:0 (its port printed, then wait for a line on stdin),
    and a source that connects to the line, streams ``nbytes`` and waits for the sink's one
    byte saying it has them all. Prints {"seconds", "bytes"}."""
    sink = socket.create_server(("127.0.0.1", 0))
    print(json.dumps({"sink": sink.getsockname()[1]}), flush=True)
    sys.stdin.readline()

    def serve() -> None:
        conn, _ = sink.accept()
        buf = bytearray(4 * MiB)
        view = memoryview(buf)
        got = 0
        while got < nbytes:
            n = conn.recv_into(view)
            if n == 0:
                raise SystemExit("the stream ended early")
            got += n
        conn.sendall(b"k")
        conn.close()

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    src = socket.create_connection(("127.0.0.1", line_port))
    src.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    block = b"\x5a" * chunk
    t0 = time.perf_counter()
    left = nbytes
    while left > 0:
        n = min(left, chunk)
        src.sendall(block if n == chunk else block[:n])
        left -= n
    if src.recv(1) != b"k":
        raise SystemExit("no answer from the sink")
    seconds = time.perf_counter() - t0
    server.join(JOIN_TIMEOUT)
    print(json.dumps({"seconds": seconds, "bytes": nbytes}), flush=True)


def measure_plain(
    delay: float, nbytes: int, *, rate: float | None = None, chunk: int = MiB
) -> float:
    """MiB/s of one TCP stream of ``nbytes`` through a line of ``delay`` seconds each way, from
    the first byte sent to the sink's answer (so one round trip is in it, as in an MPI
    streaming benchmark's closing acknowledgement)."""
    sink: dict[str, int] = {}
    with DelayLine(lambda: ("127.0.0.1", sink["port"]), delay, rate=rate) as line:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--endpoints", str(line.port)]
        cmd += ["--bytes", str(nbytes), "--chunk", str(chunk)]
        with subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        ) as child:
            assert child.stdin is not None and child.stdout is not None
            sink["port"] = json.loads(child.stdout.readline())["sink"]
            child.stdin.write("go\n")
            child.stdin.flush()
            out = child.stdout.read()
            if child.wait(timeout=600) != 0:
                raise RuntimeError(f"the stream's endpoints failed ({child.returncode})")
        res = json.loads(out.strip().splitlines()[-1])
    return float(res["bytes"]) / float(res["seconds"]) / MiB


def _size(text: str) -> int:
    units = {"k": 1024, "m": MiB, "g": 1024 * MiB}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--delay", type=float, nargs="+", default=[20.0], help="ms each way")
    ap.add_argument("--bytes", default="1G", help="bytes streamed per measurement (1G, 256M)")
    ap.add_argument("--rate", type=float, default=0.0, help="bottleneck in MiB/s (0: none)")
    ap.add_argument("--chunk", type=int, default=MiB, help=argparse.SUPPRESS)
    ap.add_argument("--forward", default="", help="HOST:PORT: only forward, until interrupted")
    ap.add_argument("--listen", type=int, default=0, help="port of --forward's line")
    ap.add_argument("--endpoints", type=int, default=0, help=argparse.SUPPRESS)
    opts = ap.parse_args()
    nbytes = _size(opts.bytes)
    if opts.endpoints:
        _endpoints(opts.endpoints, nbytes, opts.chunk)
        return
    rate = opts.rate * MiB if opts.rate else None
    if opts.forward:
        host, _, port = opts.forward.rpartition(":")
        line = DelayLine((host, int(port)), opts.delay[0] / 1000, port=opts.listen, rate=rate)
        print(f"forwarding 127.0.0.1:{line.port} -> {opts.forward}, {opts.delay[0]} ms each way")
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            line.close()
        return
    for ms in opts.delay:
        bw = measure_plain(ms / 1000, nbytes, rate=rate, chunk=opts.chunk)
        print(f"plain TCP through a {ms:g} ms line, {nbytes / MiB:.0f} MiB: {bw:.0f} MiB/s")


if __name__ == "__main__":
    main()
