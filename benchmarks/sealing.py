"""What opening a sealed message costs the receiving agent, per size, in one process.

    .venv/bin/python benchmarks/sealing.py [--quick]

cryptography 51 refuses a ``decrypt_into`` whose output overlaps its input, so the agent can
no longer decrypt a frame over itself in one call. ``Sealer.open`` decrypts a large frame it
owns in place through a cache-sized scratch buffer instead (``protocol/sealing.py``). This
times, for each size, the best of several runs of (the frame as the agent holds it, a
``bytearray`` of its own, made before each run and not timed):

- ``copy``: copying the sealed frame into a buffer allocated once (a memcpy: what touching
  every byte once costs; the baseline every other figure is divided by);
- ``open``: ``Sealer.open`` (in place from ``IN_PLACE_MIN`` up);
- ``new buffer``: one ``decrypt_into`` into a separate buffer allocated for it (what the
  simple fix would cost);
- ``one call in place``: ``decrypt_into`` over itself, where the installed cryptography still
  allows it (50 and older), else ``n/a``.

``open`` close to ``one call in place`` means the scratch buffer costs nothing that matters.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TypeVar

import cryptography
import msgspec
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from vpool.protocol.framing import PREFIX_SIZE, encode_frame, frames_in
from vpool.protocol.messages import Data
from vpool.protocol.sealing import IN_PLACE_MIN, Sealer, message_key, nonce

KEY = message_key("YmVuY2htYXJrLWpvYi1rZXktb2YtMzItYnl0ZXMtbG9uZw")
T = TypeVar("T")
SIZES = (100, 64 * 1024, 1 << 20, IN_PLACE_MIN, 16 << 20, 64 << 20)


def _best(prepare: Callable[[], T], fn: Callable[[T], object], budget: float) -> float:
    """The fastest of at least 3 runs of ``fn(prepare())``, ``prepare`` untimed, repeated until
    ``budget`` seconds have gone."""
    best = float("inf")
    runs = 0
    start = time.perf_counter()
    while runs < 3 or time.perf_counter() - start < budget:
        arg = prepare()
        t0 = time.perf_counter()
        fn(arg)
        best = min(best, time.perf_counter() - t0)
        runs += 1
    return best


def measure(size: int, budget: float) -> dict[str, float | None]:
    msg = Data(job=1, src=0, dst=1, seq=1, ctx=0, tag=0, parts=[size])
    frame = encode_frame(msg, bytes(range(256)) * (size // 256) + bytes(size % 256))
    [(_, header_len, _)] = list(frames_in(frame))
    sealer = Sealer(KEY)
    sealed = bytes(sealer.seal(msg, frame, header_len))
    header = msgspec.structs.replace(msg, sealed=True)
    aead = AESGCM(KEY)
    at = PREFIX_SIZE + header_len  # payload start (the flag byte is at - 1)
    iv, aad = nonce(0, 1, 1), sealed[PREFIX_SIZE : at - 1]
    target = memoryview(bytearray(len(sealed)))

    def fresh() -> bytearray:
        """The sealed frame as the agent holds it: read into a buffer of its own."""
        return bytearray(sealed)

    def copy(_: object) -> None:
        target[:] = sealed

    def open_(buf: bytearray) -> None:
        sealer.open(header, buf, header_len)

    def new_buffer(buf: bytearray) -> None:
        out = bytearray(size)
        aead.decrypt_into(iv, memoryview(buf)[at:], aad, out)

    def one_call(buf: bytearray) -> None:
        aead.decrypt_into(iv, memoryview(buf)[at:], aad, memoryview(buf)[at : at + size])

    assert bytes(sealer.open(header, fresh(), header_len)) == frame
    try:
        one_call(fresh())
        in_place: float | None = _best(fresh, one_call, budget)
    except ValueError:  # "data and buf must not overlap"
        in_place = None
    return {
        "copy": _best(lambda: None, copy, budget),
        "open": _best(fresh, open_, budget),
        "new buffer": _best(fresh, new_buffer, budget),
        "one call in place": in_place,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short budget per figure")
    args = parser.parse_args()
    budget = 0.05 if args.quick else 0.5
    print(f"cryptography {cryptography.__version__}; best of runs, ms (ratio to copy)")
    names = ("copy", "open", "new buffer", "one call in place")
    print(f"{'size':>10}  " + "  ".join(f"{n:>24}" for n in names))
    for size in SIZES:
        res = measure(size, budget)
        base = res["copy"]
        assert base is not None
        cells = []
        for name in names:
            value = res[name]
            cells.append("n/a" if value is None else f"{value * 1e3:9.3f} ({value / base:6.2f}x)")
        print(f"{size:>10}  " + "  ".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
