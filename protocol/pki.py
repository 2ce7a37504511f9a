"""Certificate material of a pool's own CA: made in memory, returned as PEM bytes.

The coordinator's operator (or ``vsdk local up``) makes one CA per pool; the coordinator and
every relay get a server certificate from it; agents and ``vsdk`` trust only that CA.
"""

from __future__ import annotations

import datetime as dt
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _key_usage(*, key_cert_sign: bool = False, crl_sign: bool = False) -> x509.KeyUsage:
    """Signatures (ECDSA keys), and for a CA signing certificates and CRLs."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=key_cert_sign,
        crl_sign=crl_sign,
        encipher_only=False,
        decipher_only=False,
    )


def make_ca(name: str, *, now: dt.datetime, days: int = 3650) -> tuple[bytes, bytes]:
    """A self-signed CA: ``(cert_pem, key_pem)``."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} vpool CA")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            _key_usage(key_cert_sign=True, crl_sign=True),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def issue_server_cert(
    ca_cert_pem: bytes,
    ca_key_pem: bytes,
    *,
    common_name: str,
    dns_names: list[str],
    ip_addresses: list[str],
    now: dt.datetime,
    days: int = 825,
) -> tuple[bytes, bytes]:
    """A server certificate signed by the CA: ``(cert_pem, key_pem)``."""
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("the CA key must be an EC key")
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            _key_usage(),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        # RFC 5280 strict verification (Python 3.13's default) needs both identifiers.
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _key_pem(key)


def split_names(hosts: list[str]) -> tuple[list[str], list[str]]:
    """``hosts`` as the two kinds of name a certificate has: ``(dns_names, ip_addresses)``."""
    dns: list[str] = []
    ips: list[str] = []
    for host in hosts:
        ip = _ip(host)
        if ip is None:
            dns.append(host.rstrip(".").lower())
        else:
            ips.append(str(ip))
    return dns, ips


def cert_names(cert_pem: bytes) -> list[str]:
    """The names a certificate is valid for: its DNS names, then its IP addresses (the first
    certificate of a chain; the subject's common name does not count, as for TLS clients)."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    dns = sans.get_values_for_type(x509.DNSName)
    return dns + [str(a) for a in sans.get_values_for_type(x509.IPAddress)]


def fingerprint(cert_pem: bytes) -> str:
    """The SHA-256 digest of a certificate (of its DER form, the first of a chain), in hex:
    what ``openssl x509 -noout -fingerprint -sha256`` shows, without the colons. A volunteer
    given it by the operator trusts a pool CA fetched over an unchecked connection only if its
    digest is this (``vpool-agent join --ca-sha256``). ``ValueError`` if it is no PEM
    certificate."""
    return x509.load_pem_x509_certificate(cert_pem).fingerprint(hashes.SHA256()).hex()


def is_ca(cert_pem: bytes) -> bool:
    """Whether the certificate may sign others (basic constraints: CA)."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False


def covers(cert_pem: bytes, host: str) -> bool:
    """Whether a client connecting to ``host`` accepts the certificate (names only: the CA
    and the dates are the handshake's business). ``host`` is a DNS name or an IP address,
    IPv6 with or without brackets; a wildcard DNS name covers one label."""
    ip = _ip(host)
    for name in cert_names(cert_pem):
        if ip is not None:
            if _ip(name) == ip:
                return True
        elif _ip(name) is None and _dns_match(name, host):
            return True
    return False


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return None


def _dns_match(pattern: str, host: str) -> bool:
    pattern, host = pattern.rstrip(".").lower(), host.rstrip(".").lower()
    if pattern.startswith("*."):
        first, _, rest = host.partition(".")
        return bool(first) and rest == pattern[2:]
    return pattern == host
