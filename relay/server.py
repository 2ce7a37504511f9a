"""``serve_relay``: the relay's TCP+TLS server around one ``Hub``.

It listens on its TCP port and, for agents on the same machine, on the abstract Unix socket
named after that port (``protocol.local``; ``local_socket`` setting); both are served alike.

Every accepted connection is sorted by its first byte, peeked (``MSG_PEEK``) within
``handshake_timeout``: ``V`` starts the checkpoint store's preamble (``ckptstore``), anything
else is an agent connection (a TLS ClientHello starts with 0x16, a plain frame with a small
big-endian length), which then gets TLS (``trio.SSLStream``) and a ``Connection``. A store
connection whose 8 bytes are not the preamble is closed.
"""

from __future__ import annotations

import logging
import socket
import ssl
import sys
from pathlib import Path

import httpx
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from vpool import tls
from vpool.protocol.errors import TokenError
from vpool.protocol.local import local_socket_name
from vpool.protocol.tokens import public_key_from_text
from vpool.reasons import describe
from vpool.relay.ckptstore import STORE_PREAMBLE
from vpool.relay.connection import Connection
from vpool.relay.errors import RelayError, StorageError
from vpool.relay.hub import Hub
from vpool.relay.registry import CoordinatorClient, register_request, run_registry
from vpool.relay.settings import RelaySettings

logger = logging.getLogger(__name__)


def _peer(tcp: trio.SocketStream) -> str:
    if tcp.socket.family == socket.AF_UNIX:
        return "this host (unix socket)"
    try:
        host, port = tcp.socket.getpeername()[:2]
    except OSError:
        return "?"
    return f"{host}:{port}"


async def _local_listener(port: int) -> trio.SocketListener | None:
    """The abstract Unix socket of ``port`` (``protocol.local``), or None if it is taken."""
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await sock.bind(local_socket_name(port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        logger.warning(
            "no same-host socket for port %d (%s): agents here use TCP", port, describe(exc)
        )
        return None
    return trio.SocketListener(sock)


async def _is_store(tcp: trio.SocketStream, peer: str) -> bool | None:
    """True after a store preamble was read, False for an agent connection (nothing read),
    None for one to close (closed, or a bad preamble)."""
    sock = tcp.socket
    got = b""
    try:
        first = await sock.recv(1, socket.MSG_PEEK)
        if not first:
            return None
        if first != STORE_PREAMBLE[:1]:
            return False
        for _ in range(len(STORE_PREAMBLE)):
            data = await sock.recv(len(STORE_PREAMBLE) - len(got))
            got += data
            if not data or len(got) == len(STORE_PREAMBLE):
                break
    except OSError:
        return None
    if got == STORE_PREAMBLE:
        return True
    logger.info("connection from %s: %r is not the store preamble; closed", peer, got)
    return None


async def serve_relay(
    settings: RelaySettings,
    *,
    signing_key: Ed25519PublicKey | None = None,
    coordinator_transport: httpx.AsyncBaseTransport | None = None,
    hub_ready: trio.MemorySendChannel[Hub] | None = None,
    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve agents until cancelled; ``task_status.started((host, port))`` once listening.

    ``signing_key`` (else the ``signing_key`` setting, else the coordinator's answer to
    registration) verifies tokens. ``coordinator_transport`` replaces the HTTP transport to
    the coordinator (tests). ``hub_ready`` receives the hub, for tests that inspect it.
    """
    if settings.tls_cert and settings.tls_key:
        ssl_context = tls.server_context(Path(settings.tls_cert), Path(settings.tls_key))
    elif settings.insecure_tcp:
        ssl_context = None
        logger.warning("serving plain TCP without TLS (insecure_tcp)")
    else:
        raise RelayError("tls_cert and tls_key are required (or set insecure_tcp for tests)")
    if signing_key is None and settings.signing_key:
        try:
            signing_key = public_key_from_text(settings.signing_key)
        except TokenError as exc:
            raise RelayError(f"bad signing_key setting: {exc.message}") from exc
    if signing_key is None and not settings.coordinator_url:
        raise RelayError("no coordinator_url and no signing_key: tokens cannot be verified")

    listeners = await trio.open_tcp_listeners(settings.port, host=settings.host or None)
    host, port = listeners[0].socket.getsockname()[:2]
    if settings.local_socket and sys.platform == "linux":
        local = await _local_listener(port)
        if local is not None:
            listeners.append(local)
    name = settings.relay_name(port)
    hub = Hub(settings, settings.data_path(name), name=name, signing_key=signing_key)
    try:
        hub.data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageError(
            f"cannot create the data directory {hub.data_dir}: {describe(exc)}"
        ) from exc
    await trio.to_thread.run_sync(hub.load)

    async def handle(tcp: trio.SocketStream) -> None:
        peer = _peer(tcp)
        try:
            store = None
            with trio.move_on_after(settings.handshake_timeout) as scope:
                store = await _is_store(tcp, peer)
            if scope.cancelled_caught:
                logger.info("connection from %s: nothing received in time; closed", peer)
            if store is None:
                await trio.aclose_forcefully(tcp)
            elif store:
                await hub.store.supervisor.serve(tcp, peer)
            else:
                await Connection(hub, _secured(tcp, ssl_context), peer=peer).run()
        except* StorageError:
            # The log cannot be written: no connection can be served honestly any more.
            raise
        except* Exception:
            # A bug met on one connection must not take every other connection down.
            logger.exception("agent connection from %s failed", peer)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.watch_lost)
        await nursery.start(hub.store.supervisor.run)
        if settings.coordinator_url:
            client = CoordinatorClient(
                settings.coordinator_url,
                settings.relay_key,
                ca=settings.coordinator_ca,
                transport=coordinator_transport,
            )
            req = register_request(hub, settings.advertised_host(), port)
            nursery.start_soon(run_registry, hub, client, req)
        await nursery.start(trio.serve_listeners, handle, listeners)
        logger.info("relay %s listening on %s:%d, logs in %s", name, host, port, hub.data_dir)
        if hub_ready is not None:
            hub_ready.send_nowait(hub)
        task_status.started((host, port))


def _secured(tcp: trio.SocketStream, ssl_context: ssl.SSLContext | None) -> trio.abc.Stream:
    if ssl_context is None:
        return tcp
    # What trio.SSLListener would do.
    return trio.SSLStream(tcp, ssl_context, server_side=True, https_compatible=False)
