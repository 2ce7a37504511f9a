"""Whole lines from output chunks, per rank and stream, as ``mpiexec`` shows them.

Output arrives as chunks cut anywhere (an agent posts what a pipe gave it). ``LineAssembler``
keeps one partial line per (rank, stream) and hands out only whole lines, so two ranks never
share a line; at the end, ``flush`` gives the partial lines that never got their newline. Used
by ``vsdk`` (``--wait``, ``logs``) and the web portal's job page.
"""

from __future__ import annotations

from collections.abc import Iterable

from vpool.protocol.api import OutputRecord

Line = tuple[int, str, bytes]  # (rank, stream, bytes of whole lines incl. the newline)


class LineAssembler:
    """Turns output chunks into whole lines, per rank and stream.

    ``label`` prefixes each line with ``[rank] `` like ``mpiexec -l``.
    """

    def __init__(self, *, label: bool = False) -> None:
        self._label = label
        self._partial: dict[tuple[int, str], bytes] = {}

    def _tag(self, rank: int, data: bytes) -> bytes:
        if not self._label:
            return data
        prefix = f"[{rank}] ".encode()
        lines = data.splitlines(keepends=True)
        return b"".join(prefix + line for line in lines)

    def feed(self, rank: int, stream: str, data: bytes) -> list[Line]:
        """Take one chunk; return the lines it completed (one item, possibly several lines)."""
        key = (rank, stream)
        buf = self._partial.pop(key, b"") + data
        cut = buf.rfind(b"\n") + 1
        if cut < len(buf):
            self._partial[key] = buf[cut:]
        if not cut:
            return []
        return [(rank, stream, self._tag(rank, buf[:cut]))]

    def feed_records(self, records: Iterable[OutputRecord]) -> list[Line]:
        out: list[Line] = []
        for rec in records:
            out += self.feed(rec.rank, rec.stream, rec.data)
        return out

    def pending(self) -> dict[tuple[int, str], bytes]:
        """The partial lines held, by (rank, stream)."""
        return dict(self._partial)

    def flush(self) -> list[Line]:
        """The partial lines left at the end, by rank. Each stream's output stays as the
        program wrote it, except that a partial line followed by another rank's partial line
        gets a newline, so the two never share a line."""
        keys = sorted(self._partial)
        out: list[Line] = []
        for i, (rank, stream) in enumerate(keys):
            data = self._partial[(rank, stream)]
            if any(s == stream for _, s in keys[i + 1 :]):
                data += b"\n"
            out.append((rank, stream, self._tag(rank, data)))
        self._partial.clear()
        return out
