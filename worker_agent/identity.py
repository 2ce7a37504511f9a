"""The agent's identity: an Ed25519 key kept in ``identity_dir/identity.key`` (mode 0600).

The key outlives restarts so the coordinator sees the same machine again; enrolling proves
possession of it by signing the current time (``tokens.sign_possession``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from vpool import __version__
from vpool.protocol import tokens
from vpool.protocol.api import EnrollRequest
from vpool.protocol.errors import TokenError
from vpool.worker_agent.errors import AgentError

KEY_FILE = "identity.key"


def load_or_create_key(identity_dir: Path) -> Ed25519PrivateKey:
    """The agent's private key, created (0600, in a 0700 directory) on first use."""
    identity_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = identity_dir / KEY_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return _create(path)
    try:
        return tokens.private_key_from_bytes(data)
    except (TokenError, ValueError) as exc:
        raise AgentError(f"{path} is not an Ed25519 private key: {exc}") from exc


def _create(path: Path) -> Ed25519PrivateKey:
    key = Ed25519PrivateKey.generate()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    # O_EXCL with mode 0600 from the start: the key is never readable by others, not even briefly.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(tokens.private_key_bytes(key))
            f.flush()
            os.fsync(f.fileno())
        try:
            # link, not rename: if another agent created the key meanwhile, keep theirs.
            os.link(tmp, path)
        except FileExistsError:
            return tokens.private_key_from_bytes(path.read_bytes())
    finally:
        tmp.unlink(missing_ok=True)
    return key


def enroll_request(
    key: Ed25519PrivateKey, *, name: str, slots: int, join_token: str
) -> EnrollRequest:
    timestamp = round(time.time(), 3)
    public_key, signature = tokens.sign_possession(key, timestamp)
    return EnrollRequest(
        public_key=public_key,
        timestamp=timestamp,
        signature=signature,
        name=name,
        slots=slots,
        software=f"vpool-agent {__version__}",
        join_token=join_token,
    )
