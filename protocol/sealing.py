"""Message payloads sealed for the relays: relays keep and forward only ciphertext.

The agent of the sending rank seals a ``Data`` frame's payload with the job's message key
(AES-256-GCM) before it leaves for a relay; the agent of the receiving rank opens it before the
rank sees it. Ranks never see sealed frames, and two ranks on one agent exchange plaintext
(agent-local delivery) while the copy logged at the relay is sealed.

**The key** is derived (HKDF-SHA256) from the job's secret key that leases carry
(``Lease.ckpt_key``, which also encrypts checkpoint images), under its own label: relays never
see either.

**The nonce is the message's identity** ``(src, dst, seq)``, unique within a job, so sealing is
deterministic: a re-sent copy of a message (after a restart, a reconnection) is the same bytes
as the logged one, and the relay's determinism check (a digest of the frame, compared with the
logged one's) keeps working on ciphertext. The digest of a sealed frame is a keyed digest of
the plaintext, computed by whom holds the key: the relay detects a divergent re-send without
reading anything. The price: a program that is not deterministic re-sends a message under the
same nonce with other content, which tells the relay the XOR of the two versions of that one
message (its job fails for it, as every divergent job does).

**The header stays readable**, since relays route and order by it (job, src, dst, seq, ctx,
tag, kind, part lengths); all of it is authenticated as associated data, so a relay cannot
move a payload to another message or change its envelope unnoticed. A frame that fails to
open is ``SealError``: the relay, or the path to it, changed it.
"""

from __future__ import annotations

import base64
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from vpool.protocol.framing import PREFIX, PREFIX_SIZE, Buffer
from vpool.protocol.messages import Data

TAG_SIZE: Final = 16
KEY_INFO: Final = b"vpool message payloads v1"
_RANK_BITS = 24  # nonce: src (24 bits), dst (24 bits), seq (48 bits)
_SEQ_BITS = 48
# Frames opened in place (``Sealer.open``): those of IN_PLACE_MIN bytes or more, decrypted
# SCRATCH bytes at a time. Below it a new buffer costs as little (the allocator reuses its heap
# for sizes under its mmap threshold) and one call is quicker than a stream's set-up; above
# it a new buffer is fresh pages: 60 ms to open 64 MiB, against 20 ms in place
# (benchmarks/sealing.py).
IN_PLACE_MIN: Final = 4 << 20
SCRATCH: Final = 256 * 1024
_BLOCK: Final = 16  # update_into asks for room for one block more than it is given


class SealError(Exception):
    """A sealed payload did not open: it was changed on the way, or sealed with another key."""


def message_key(job_key: str) -> bytes:
    """The job's message key (32 bytes) from its secret key (base64url, as in leases)."""
    raw = base64.urlsafe_b64decode(job_key + "=" * (-len(job_key) % 4))
    if len(raw) < 16:
        raise ValueError("a job key has at least 128 bits")
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=KEY_INFO).derive(raw)


def nonce(src: int, dst: int, seq: int) -> bytes:
    if not (0 <= src < 1 << _RANK_BITS and 0 <= dst < 1 << _RANK_BITS and 0 < seq < 1 << _SEQ_BITS):
        raise ValueError(f"message ({src}, {dst}, {seq}) is outside the nonce space")
    return ((src << (_RANK_BITS + _SEQ_BITS)) | (dst << _SEQ_BITS) | seq).to_bytes(12, "big")


_FALSE, _TRUE = 0xC2, 0xC3  # MessagePack's false and true


def _flag(frame: Buffer, header_len: int, sealed: bool) -> int:
    """The offset of the header's last byte, ``Data.sealed`` (its last field, ``array_like``),
    checked to say ``sealed``."""
    at = PREFIX_SIZE + header_len - 1
    if memoryview(frame)[at] != (_TRUE if sealed else _FALSE):
        raise SealError("the header does not end with the sealed flag")
    return at


class Sealer:
    """Seals and opens the ``Data`` frames of one job (one thread at a time: opening uses a
    scratch buffer of the instance's).

    The associated data is the header's bytes but its last, the ``sealed`` flag: the envelope
    exactly as the relay forwards it. Sealing copies the header with the flag set. Opening a
    large frame the caller owns (a ``bytearray`` of ``IN_PLACE_MIN`` bytes or more, as the
    receiving agent reads big payloads) decrypts it in place, through a scratch buffer of
    ``SCRATCH`` bytes that stays in the CPU's cache: cryptography 51 refuses overlapping
    input and output buffers, so each chunk is decrypted beside the frame and copied back,
    which costs 1.15x what one in-place call cost before and never a second frame-sized
    allocation (``benchmarks/sealing.py``). Anything else opens into a new buffer."""

    __slots__ = ("_aead", "_key", "_scratch")

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._key = key
        self._scratch: bytearray | None = None

    def seal(self, msg: Data, frame: Buffer, header_len: int) -> bytearray:
        """The sealed frame of the plaintext ``frame`` (whose header is ``msg``)."""
        at = _flag(frame, header_len, False)
        view = memoryview(frame)
        payload_len = len(view) - at - 1
        out = bytearray(len(view) + TAG_SIZE)
        PREFIX.pack_into(out, 0, header_len, payload_len + TAG_SIZE)
        out[PREFIX_SIZE:at] = view[PREFIX_SIZE:at]
        out[at] = _TRUE
        self._aead.encrypt_into(
            nonce(msg.src, msg.dst, msg.seq), view[at + 1 :], view[PREFIX_SIZE:at],
            memoryview(out)[at + 1 :],
        )  # fmt: skip
        return out

    def open(self, msg: Data, frame: Buffer, header_len: int) -> Buffer:
        """The plaintext frame of the sealed ``frame`` (whose header is ``msg``); ``SealError``
        if it does not open. A large ``bytearray`` is opened in place (a view of it is
        returned; after a ``SealError`` its payload is garbage)."""
        at = _flag(frame, header_len, True)
        payload_len = len(frame) - at - 1 - TAG_SIZE
        if not msg.sealed or payload_len < 0:
            raise SealError(f"message {msg.seq} from rank {msg.src} is not sealed")
        view = memoryview(frame)
        iv = nonce(msg.src, msg.dst, msg.seq)
        aad = bytes(view[PREFIX_SIZE:at])
        try:
            if isinstance(frame, bytearray) and payload_len >= IN_PLACE_MIN:
                out = frame
                self._open_in_place(iv, aad, view[at + 1 :], payload_len)
            else:
                out = bytearray(at + 1 + payload_len)
                out[:at] = view[:at]
                self._aead.decrypt_into(iv, view[at + 1 :], aad, memoryview(out)[at + 1 :])
        except (InvalidTag, ValueError) as exc:
            raise SealError(
                f"message {msg.seq} from rank {msg.src} to rank {msg.dst} of job {msg.job} "
                "does not open with the job's key: it was changed on its way"
            ) from exc
        PREFIX.pack_into(out, 0, header_len, payload_len)
        out[at] = _FALSE
        return memoryview(out)[: at + 1 + payload_len]

    def _open_in_place(self, iv: bytes, aad: bytes, sealed: memoryview, size: int) -> None:
        """Decrypt ``sealed`` (ciphertext of ``size`` bytes, then the tag) over itself, one
        scratch-sized chunk at a time (raises ``InvalidTag``)."""
        if self._scratch is None:
            self._scratch = bytearray(SCRATCH + _BLOCK)
        scratch = memoryview(self._scratch)
        tag = bytes(sealed[size:])
        decryptor = Cipher(algorithms.AES(self._key), modes.GCM(iv, tag)).decryptor()
        decryptor.authenticate_additional_data(aad)
        for start in range(0, size, SCRATCH):
            chunk = sealed[start : min(start + SCRATCH, size)]
            n = decryptor.update_into(chunk, scratch)
            chunk[:n] = scratch[:n]  # GCM is a stream mode: n == len(chunk)
        decryptor.finalize()
