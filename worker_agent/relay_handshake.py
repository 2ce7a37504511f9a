"""Opening one agent -> relay connection: TCP, TLS 1.3, ``Hello`` -> ``Welcome``
(docs/internals.md, "Agent <-> relay", step 1)."""

from __future__ import annotations

import ssl

import trio

from vpool import __version__
from vpool.framestream import FrameStream
from vpool.protocol.api import RelayInfo
from vpool.protocol.errors import ProtocolError
from vpool.protocol.framing import encode_frame
from vpool.protocol.messages import PROTOCOL_VERSION, Error, Hello, Welcome
from vpool.protocol.session import Session
from vpool.reasons import describe
from vpool.sockopts import set_keepalive
from vpool.worker_agent.errors import RelayLinkError


async def handshake(
    info: RelayInfo,
    where: str,
    *,
    ssl_context: ssl.SSLContext,
    token: str,
    max_payload: int,
    seconds: float,
    pings: bool = False,
) -> tuple[trio.SSLStream[trio.SocketStream], FrameStream, Session, Welcome]:
    """Connect to the relay ``info`` (``where`` names it in errors) within ``seconds``; the
    open stream, its frame reader, the session (open) and the relay's ``Welcome``. ``pings``:
    tell the relay this agent pings a quiet connection (``Hello.pings``). Raises
    ``RelayLinkError`` saying why not."""
    session = Session("relay", "client")
    try:
        with trio.fail_after(seconds):
            tcp = await trio.open_tcp_stream(info.host, info.port)
            set_keepalive(tcp.socket)
            stream = trio.SSLStream(tcp, ssl_context, server_hostname=info.host)
            try:
                await stream.do_handshake()
                reader = FrameStream(stream, max_payload=max_payload)
                hello = Hello(
                    version=PROTOCOL_VERSION,
                    role="agent",
                    token=token,
                    software=f"vpool-agent {__version__}",
                    pings=pings,
                )
                session.send(hello)
                await stream.send_all(encode_frame(hello))
                frame = await reader.receive()
                if frame is None:
                    raise RelayLinkError(f"{where} closed the connection after Hello")
                session.receive(frame.message)
                if isinstance(frame.message, Error):
                    raise RelayLinkError(
                        f"{where} refused this agent: {frame.message.code}: {frame.message.message}"
                    )
                assert isinstance(frame.message, Welcome)
                if frame.message.version != PROTOCOL_VERSION:
                    raise RelayLinkError(
                        f"{where} speaks protocol {frame.message.version}, "
                        f"this agent {PROTOCOL_VERSION}"
                    )
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
    except trio.TooSlowError as exc:
        raise RelayLinkError(
            f"{where} did not answer within {seconds:g} s", relay=info.name
        ) from exc
    except (OSError, trio.BrokenResourceError, ssl.SSLError, ProtocolError) as exc:
        raise RelayLinkError(
            f"cannot connect to {where}: {describe(exc)}", relay=info.name
        ) from exc
    return stream, reader, session, frame.message
