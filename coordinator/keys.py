"""The coordinator's credentials on disk and the users' API tokens.

``signing.key`` (Ed25519, mode 0600) signs agent and rank tokens; it is made on first start and
must survive restarts, or every enrolled agent and running rank loses its token. API tokens are
shown once and only their sha256 is stored; so are join tokens and relay keys.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from vpool.protocol.tokens import private_key_bytes, private_key_from_bytes

TOKEN_PREFIX = "vpt_"  # a user's API token
JOIN_PREFIX = "vpj_"  # a join token: admits new agents
RELAY_PREFIX = "vpr_"  # a relay's key


def load_or_create_signing_key(path: Path) -> Ed25519PrivateKey:
    if path.exists():
        return private_key_from_bytes(path.read_bytes())
    key = Ed25519PrivateKey.generate()
    write_private(path, private_key_bytes(key))
    return key


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` readable by the owner only, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def new_api_token(prefix: str = TOKEN_PREFIX) -> tuple[str, str]:
    """A fresh secret (a user's API token unless ``prefix`` says otherwise) and the hash to
    store."""
    token = prefix + secrets.token_urlsafe(32)
    return token, hash_token(token)


def new_session_secret() -> str:
    """A portal session cookie or CSRF secret (256 random bits)."""
    return secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
