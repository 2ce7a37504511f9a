"""The browser harness itself, against a tiny real HTTPS server with a throwaway self-signed
certificate: the pinned key is what makes Chromium trust it, pages run their scripts and set
their cookies, every request stays on the server, downloads and screenshots land on disk."""

from __future__ import annotations

import datetime
import io
import ipaddress
import ssl
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from browser_helpers import Browser, OpenBrowser
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

PAGE = b"""<!doctype html>
<html><head><meta charset="utf-8"><title>harness</title>
<link rel="stylesheet" href="/a.css"><script src="/a.js" defer></script></head>
<body><h1>harness</h1><div id="out"></div><a id="dl" href="/file.zip">download</a></body></html>
"""
CSS = b"h1 { color: rgb(1, 2, 3); }\n"
JS = b"document.getElementById('out').textContent = 'script ran';\n"


def _zip_bytes() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("hello.txt", "hello from the harness\n")
    return buf.getvalue()


ZIP = _zip_bytes()


def make_self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A self-signed (CA-less) certificate for the IP 127.0.0.1 and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"vpool test {name}")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / f"{name}-cert.pem", directory / f"{name}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


@dataclass
class Server:
    url: str  # https://127.0.0.1:PORT (no trailing slash)
    cert: Path
    paths: list[str] = field(default_factory=list)  # every request path served, in order


class _Handler(BaseHTTPRequestHandler):
    server: _TLSServer

    def do_GET(self) -> None:
        self.server.record.paths.append(self.path)
        headers: list[tuple[str, str]] = []
        if self.path == "/":
            body, ctype = PAGE, "text/html; charset=utf-8"
            headers.append(("Set-Cookie", "s=1; Secure; HttpOnly; SameSite=Strict; Path=/"))
        elif self.path == "/a.css":
            body, ctype = CSS, "text/css"
        elif self.path == "/a.js":
            body, ctype = JS, "text/javascript"
        elif self.path == "/file.zip":
            body, ctype = ZIP, "application/zip"
            headers.append(("Content-Disposition", 'attachment; filename="file.zip"'))
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _TLSServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, context: ssl.SSLContext, record: Server) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.context = context
        self.record = record

    def get_request(self) -> tuple[Any, Any]:
        # The TLS handshake happens in the request's thread (on first read), never in the
        # accepting loop, so a browser that refuses the certificate cannot stall the server.
        sock, addr = self.socket.accept()
        return self.context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # refused handshakes (test of the wrong pin) and dropped connections


@pytest.fixture
def https_server(tmp_path: Path) -> Iterator[Server]:
    cert, key = make_self_signed(tmp_path, "server")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    record = Server(url="", cert=cert)
    server = _TLSServer(context, record)
    record.url = f"https://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield record
    finally:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()


def _load(b: Browser, server: Server) -> None:
    b.get(server.url + "/")
    b.wait_for("#out", text="script ran", timeout=20)


def test_page_loads_over_https_with_the_pinned_certificate(
    browser: OpenBrowser, https_server: Server
) -> None:
    b = browser(https_server.cert)
    _load(b, https_server)
    assert b.driver.title == "harness"
    color = b.driver.find_element("css selector", "h1").value_of_css_property("color")
    assert color in ("rgba(1, 2, 3, 1)", "rgb(1, 2, 3)")  # the stylesheet applied

    cookie = {c["name"]: c for c in b.cookies()}["s"]
    assert cookie["value"] == "1"
    assert cookie["secure"] is True
    assert cookie["httpOnly"] is True
    assert cookie["sameSite"] == "Strict"
    assert b.driver.execute_script("return document.cookie") == ""  # HttpOnly indeed

    urls = b.requested_urls()
    paths = [urlsplit(u).path for u in urls]
    for path in ("/", "/a.css", "/a.js"):
        assert path in paths, urls
    origin = urlsplit(https_server.url)
    for url in urls:
        parts = urlsplit(url)
        assert (parts.scheme, parts.netloc) == (origin.scheme, origin.netloc), url


def test_a_different_pinned_certificate_is_refused(
    browser: OpenBrowser, https_server: Server, tmp_path: Path
) -> None:
    other, _ = make_self_signed(tmp_path, "other")
    b = browser(other)
    b.get(https_server.url + "/")
    b.wait_until(
        lambda d: "ERR_CERT" in d.page_source or "Privacy error" in d.title,
        timeout=15,
        message="no certificate error page",
    )
    assert not b.driver.find_elements("css selector", "#out")
    assert "/" not in https_server.paths  # no request ever got through the TLS handshake


def test_a_download_lands_in_the_downloads_directory(
    browser: OpenBrowser, https_server: Server, tmp_path: Path
) -> None:
    downloads = tmp_path / "dl"
    b = browser(https_server.cert, downloads=downloads)
    _load(b, https_server)
    b.wait_for("#dl").click()
    path = b.wait_for_download(".zip", timeout=20)
    assert path == downloads / "file.zip"
    assert path.read_bytes() == ZIP


def test_a_screenshot_is_a_png(browser: OpenBrowser, https_server: Server) -> None:
    b = browser(https_server.cert)
    _load(b, https_server)
    path = b.screenshot("page")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    width = int.from_bytes(data[16:20], "big")
    height = int.from_bytes(data[20:24], "big")
    assert width > 0 and height > 0
