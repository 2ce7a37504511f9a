"""Certificates from the pool CA complete a real TLS 1.3 handshake (in memory) and only with it."""

from __future__ import annotations

import datetime as dt
import ipaddress
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from vpool.protocol.pki import cert_names, covers, issue_server_cert, make_ca, split_names
from vpool.tls import client_context, server_context

NOW = dt.datetime.now(dt.UTC)


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext, hostname: str) -> str:
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    cli = client.wrap_bio(c_in, c_out, server_hostname=hostname)
    srv = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        for obj, out, peer_in in ((cli, c_out, s_in), (srv, s_out, c_in)):
            try:
                obj.do_handshake()
            except ssl.SSLWantReadError:
                pass
            peer_in.write(out.read())
        if cli.version() and srv.version():
            try:
                cli.do_handshake()
                srv.do_handshake()
                return str(cli.version())
            except ssl.SSLWantReadError:
                continue
    raise AssertionError("handshake did not finish")


def _files(tmp_path: Path, name: str, cert: bytes, key: bytes) -> tuple[Path, Path]:
    (tmp_path / f"{name}.pem").write_bytes(cert)
    (tmp_path / f"{name}.key").write_bytes(key)
    return tmp_path / f"{name}.pem", tmp_path / f"{name}.key"


def test_server_cert_verifies_against_its_ca(tmp_path: Path) -> None:
    ca_cert, ca_key = make_ca("test", now=NOW)
    cert, key = issue_server_cert(
        ca_cert,
        ca_key,
        common_name="relay",
        dns_names=["localhost"],
        ip_addresses=["127.0.0.1"],
        now=NOW,
    )
    (tmp_path / "ca.pem").write_bytes(ca_cert)
    srv = server_context(*_files(tmp_path, "relay", cert, key))
    assert _handshake(srv, client_context(tmp_path / "ca.pem"), "127.0.0.1") == "TLSv1.3"


def test_strict_verification_as_python_3_13_does(tmp_path: Path) -> None:
    """The pool's clients verify as Python 3.13 does by default (RFC 5280 strict), whatever
    Python runs them: a certificate without an Authority Key Identifier, as this module
    made them before, is refused; the ones it makes now pass."""
    assert client_context(None).verify_flags & ssl.VERIFY_X509_STRICT
    ca_cert, ca_key = make_ca("test", now=NOW)
    (tmp_path / "ca.pem").write_bytes(ca_cert)
    key = ec.generate_private_key(ec.SECP256R1())
    ca = x509.load_pem_x509_certificate(ca_cert)
    signer = serialization.load_pem_private_key(ca_key, password=None)
    assert isinstance(signer, ec.EllipticCurvePrivateKey)
    old = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "relay")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - dt.timedelta(minutes=5))
        .not_valid_after(NOW + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(signer, hashes.SHA256())
    )
    old_pem = old.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    srv = server_context(*_files(tmp_path, "old", old_pem, key_pem))
    with pytest.raises(ssl.SSLCertVerificationError, match="Authority Key Identifier"):
        _handshake(srv, client_context(tmp_path / "ca.pem"), "127.0.0.1")
    cert, key_now = issue_server_cert(
        ca_cert, ca_key, common_name="relay", dns_names=[], ip_addresses=["127.0.0.1"], now=NOW
    )
    srv = server_context(*_files(tmp_path, "new", cert, key_now))
    assert _handshake(srv, client_context(tmp_path / "ca.pem"), "127.0.0.1") == "TLSv1.3"


def test_another_ca_is_refused(tmp_path: Path) -> None:
    ca_cert, ca_key = make_ca("good", now=NOW)
    other_cert, _ = make_ca("evil", now=NOW)
    cert, key = issue_server_cert(
        ca_cert, ca_key, common_name="relay", dns_names=[], ip_addresses=["127.0.0.1"], now=NOW
    )
    (tmp_path / "other.pem").write_bytes(other_cert)
    srv = server_context(*_files(tmp_path, "relay", cert, key))
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(srv, client_context(tmp_path / "other.pem"), "127.0.0.1")


def _names(dns: list[str], ips: list[str]) -> bytes:
    ca_cert, ca_key = make_ca("test", now=NOW)
    cert, _ = issue_server_cert(
        ca_cert, ca_key, common_name="server", dns_names=dns, ip_addresses=ips, now=NOW
    )
    return cert


def test_covers_dns_names() -> None:
    cert = _names(["relay.example.org", "*.pool.example.org"], [])
    assert covers(cert, "relay.example.org")
    assert covers(cert, "Relay.Example.Org.")  # DNS names match as DNS does
    assert covers(cert, "eu.pool.example.org")
    assert not covers(cert, "example.org")
    assert not covers(cert, "a.eu.pool.example.org")  # a wildcard is one label
    assert not covers(cert, "pool.example.org")
    assert not covers(cert, "192.0.2.1")
    assert cert_names(cert) == ["relay.example.org", "*.pool.example.org"]


def test_covers_ip_addresses() -> None:
    cert = _names(["localhost"], ["192.0.2.10", "2001:db8::1"])
    assert covers(cert, "192.0.2.10")
    assert covers(cert, "2001:db8:0::1") and covers(cert, "[2001:db8::1]")
    assert not covers(cert, "192.0.2.11")
    assert not covers(cert, "127.0.0.1")  # localhost the name is not 127.0.0.1 the address
    assert cert_names(cert) == ["localhost", "192.0.2.10", "2001:db8::1"]


def test_a_certificate_without_names_covers_nothing() -> None:
    ca_cert, _ = make_ca("test", now=NOW)  # a CA names only its subject
    assert cert_names(ca_cert) == [] and not covers(ca_cert, "test vpool CA")


def test_split_names() -> None:
    assert split_names(["Relay.Example.org.", "192.0.2.1", "[::1]"]) == (
        ["relay.example.org"],
        ["192.0.2.1", "::1"],
    )
