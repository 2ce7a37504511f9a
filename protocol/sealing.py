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

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from vpool.protocol.framing import PREFIX, PREFIX_SIZE, Buffer
from vpool.protocol.messages import Data, encode

TAG_SIZE: Final = 16
KEY_INFO: Final = b"vpool message payloads v1"
_RANK_BITS = 24  # nonce: src (24 bits), dst (24 bits), seq (48 bits)
_SEQ_BITS = 48
_aad_encoder = msgspec.msgpack.Encoder()


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


def _aad(msg: Data) -> bytes:
    return _aad_encoder.encode(
        (msg.job, msg.src, msg.dst, msg.seq, msg.ctx, msg.tag, msg.kind, msg.parts)
    )


def _framed(msg: Data, payload_len: int) -> tuple[bytearray, int]:
    """A frame buffer with ``msg``'s prefix and header written, room for the payload after."""
    header = encode(msg)
    out = bytearray(PREFIX_SIZE + len(header) + payload_len)
    PREFIX.pack_into(out, 0, len(header), payload_len)
    start = PREFIX_SIZE + len(header)
    out[PREFIX_SIZE:start] = header
    return out, start


class Sealer:
    """Seals and opens the ``Data`` frames of one job."""

    __slots__ = ("_aead",)

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    def seal(self, msg: Data, frame: Buffer, header_len: int) -> tuple[Data, bytearray]:
        """The sealed message and frame of the plaintext ``frame`` (whose header is ``msg``)."""
        if msg.sealed:
            raise ValueError("the frame is sealed already")
        payload = memoryview(frame)[PREFIX_SIZE + header_len :]
        sealed = msgspec.structs.replace(msg, sealed=True)
        out, start = _framed(sealed, len(payload) + TAG_SIZE)
        self._aead.encrypt_into(
            nonce(msg.src, msg.dst, msg.seq), payload, _aad(msg), memoryview(out)[start:]
        )
        return sealed, out

    def open(self, msg: Data, frame: Buffer, header_len: int) -> tuple[Data, bytearray]:
        """The plaintext message and frame of the sealed ``frame`` (whose header is ``msg``);
        ``SealError`` if it does not open."""
        payload = memoryview(frame)[PREFIX_SIZE + header_len :]
        if not msg.sealed or len(payload) < TAG_SIZE:
            raise SealError(f"message {msg.seq} from rank {msg.src} is not sealed")
        plain = msgspec.structs.replace(msg, sealed=False)
        out, start = _framed(plain, len(payload) - TAG_SIZE)
        try:
            self._aead.decrypt_into(
                nonce(msg.src, msg.dst, msg.seq), payload, _aad(plain), memoryview(out)[start:]
            )
        except (InvalidTag, ValueError) as exc:
            raise SealError(
                f"message {msg.seq} from rank {msg.src} to rank {msg.dst} of job {msg.job} "
                "does not open with the job's key: it was changed on its way"
            ) from exc
        return plain, out
