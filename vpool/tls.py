"""TLS contexts for the pool: TLS 1.3 only, trust anchored in the pool's own CA."""

from __future__ import annotations

import ssl
from pathlib import Path


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(str(cert), str(key))
    return ctx


def client_context(ca: Path | None) -> ssl.SSLContext:
    """Verifying client context; with ``ca`` only that CA is trusted, else the system's."""
    ctx = ssl.create_default_context(cafile=str(ca) if ca else None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    # RFC 5280's rules, as Python 3.13 checks by default (Fedora's, Ubuntu 25.04's): the same
    # verdict whatever Python a volunteer's agent runs on. A pool's own certificates
    # (``protocol/pki.py``) pass; certificates made before 2026-11-26 lack the Authority Key
    # Identifier they need and must be made again (docs/operating.md).
    ctx.verify_flags |= ssl.VERIFY_X509_STRICT
    return ctx
