"""Serving the app with hypercorn's trio worker on a socket we bind ourselves.

Binding first lets ``--port 0`` work: the kernel picks the port, we hand the listening socket to
hypercorn (``fd://``) and only then write the ready file with the real port.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import ssl
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from vpool import tls
from vpool.coordinator.app import create_app
from vpool.coordinator.service import Coordinator
from vpool.coordinator.settings import CoordinatorSettings
from vpool.protocol import pki
from vpool.readyfile import Ready

log = logging.getLogger("vpool.coordinator")


class ServeError(Exception):
    """The server cannot start with these settings."""


class _Config(Config):
    """Hypercorn config whose TLS is the pool's: TLS 1.3 only (``vpool.tls``)."""

    def create_ssl_context(self) -> ssl.SSLContext | None:
        if not self.ssl_enabled:
            return None
        assert self.certfile is not None and self.keyfile is not None
        ctx = tls.server_context(Path(self.certfile), Path(self.keyfile))
        ctx.set_alpn_protocols(self.alpn_protocols)
        return ctx


def check_tls(settings: CoordinatorSettings) -> bool:
    """True to serve HTTPS; raise if neither TLS nor plain HTTP is allowed."""
    if settings.tls_cert and settings.tls_key:
        for name in (settings.tls_cert, settings.tls_key):
            if not Path(name).is_file():
                raise ServeError(f"TLS file {name} does not exist")
        if settings.public_url:
            _check_public_url(settings.public_url, Path(settings.tls_cert))
        return True
    if settings.insecure_http:
        return False
    raise ServeError(
        "tls_cert and tls_key are not set: refusing to serve plain HTTP "
        "(set insecure_http = true for a throw-away test pool)"
    )


def _check_public_url(url: str, cert: Path) -> None:
    """Clients check the certificate against the host of public_url: refuse to serve one
    they would all refuse."""
    host = urlsplit(url).hostname
    if not host:
        raise ServeError(f"public_url {url!r} names no host (https://HOST:PORT)")
    try:
        pem = cert.read_bytes()
        names = pki.cert_names(pem)
    except (OSError, ValueError) as exc:
        raise ServeError(f"cannot read the certificate {cert}: {exc}") from exc
    if not pki.covers(pem, host):
        raise ServeError(
            f"public_url {url} names {host}, which the certificate {cert} does not (it "
            f"names {', '.join(names) or 'nothing'}): clients would refuse the connection. "
            "Give the coordinator a certificate for that host, or set public_url to a name "
            "it has"
        )


def bind(host: str, port: int) -> socket.socket:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


async def _until_signal() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            return


async def serve(settings: CoordinatorSettings, ready: Ready) -> None:
    """Run until SIGTERM or SIGINT."""
    secure = check_tls(settings)
    core = Coordinator(settings)
    try:
        sock = bind(settings.host, settings.port)
        host, port = sock.getsockname()[:2]
        config = _Config()
        # Hypercorn takes ownership of the file descriptor.
        config.bind = [f"fd://{sock.detach()}"]
        config.accesslog = None
        # Through the logging tree, not a second handler of hypercorn's own.
        config.errorlog = logging.getLogger("hypercorn.error")
        config.graceful_timeout = 2.0
        if secure:
            config.certfile, config.keyfile = settings.tls_cert, settings.tls_key
        app = create_app(settings, coordinator=core)
        async with trio.open_nursery() as nursery:
            # FastAPI's ASGI annotations are not hypercorn's; the app is a plain ASGI 3 app.
            await nursery.start(
                partial(
                    hypercorn_serve,
                    app,  # type: ignore[arg-type]
                    config,
                    shutdown_trigger=_until_signal,
                )
            )
            scheme = "https" if secure else "http"
            url = settings.public_url or f"{scheme}://{_url_host(settings.host)}:{port}"
            log.info("coordinator %s listening on %s:%s (%s)", settings.pool_name, host, port, url)
            ready.announce({"host": settings.host, "port": port, "pid": os.getpid(), "url": url})
    finally:
        core.close()
        with trio.move_on_after(5, shield=True):
            await trio.to_thread.run_sync(ready.withdraw)


def _url_host(host: str) -> str:
    """How a local client reaches ``host``: a wildcard address means loopback."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"[{host}]" if ":" in host else host
