"""Mint a private CA, the broker's server certificate and client certificates for mTLS on TCP listeners.

Layout of a certs directory (keys are written mode 0600, the directory 0700 when created here)::

    ca.pem  ca.key            the CA: signs the server and client certificates, and verifies clients
    server.pem  server.key    the broker's certificate, with DNS and IP SANs
    clients/NAME.pem  .key    one per client: CN = NAME, optional SAN URI (both map to a tenant)

EC P-256 keys throughout: small, fast to verify, and accepted by gRPC's BoringSSL.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import socket
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gpubroker.wire.errors import AlreadyExists, InvalidArgument, NotFound

__all__ = [
    "CertPaths",
    "default_sans",
    "init_certs",
    "mint_ca",
    "mint_client_cert",
    "mint_server_cert",
    "tls_snippet",
    "write_atomically",
]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # also a safe file name
# Backdate a little so a client or server whose clock runs slightly behind still accepts a fresh certificate.
_SKEW = dt.timedelta(minutes=5)


@dataclass(frozen=True)
class CertPaths:
    cert: Path
    key: Path


def default_sans() -> list[str]:
    """localhost, both loopback addresses, and this host's name: what a broker on this machine is reached by."""
    sans = ["localhost", "127.0.0.1", "::1"]
    host = socket.gethostname()
    if host and host not in sans:
        sans.append(host)
    return sans


def write_atomically(path: Path, data: bytes, mode: int) -> None:
    """Atomically, with ``mode`` set before the data is visible: a key (or a token) is never readable by others,
    even briefly; the parent directory is made (0700) where missing."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _refuse_existing(paths: Sequence[Path], force: bool) -> None:
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        raise AlreadyExists(f"{', '.join(existing)}: already there; pass --force to replace")


def _validity(days: int, not_before: dt.datetime | None,
              not_after: dt.datetime | None) -> tuple[dt.datetime, dt.datetime]:
    start = not_before or dt.datetime.now(dt.UTC) - _SKEW
    end = not_after or start + _SKEW + dt.timedelta(days=days)
    if end <= start:
        raise InvalidArgument("a certificate's not_after must be later than its not_before")
    return start, end


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _load_ca(directory: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    try:
        cert = x509.load_pem_x509_certificate((directory / "ca.pem").read_bytes())
        key = serialization.load_pem_private_key((directory / "ca.key").read_bytes(), password=None)
    except FileNotFoundError:
        raise NotFound(f"no CA in {directory}; run `gpubroker certs init --dir {directory}` first") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise InvalidArgument(f"{directory / 'ca.key'} is not an EC key")
    return cert, key


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name.strip("[]")))
    except ValueError:
        return x509.DNSName(name)


def _leaf(directory: Path, subject: str, sans: list[x509.GeneralName], usage: x509.ObjectIdentifier, days: int,
          not_before: dt.datetime | None, not_after: dt.datetime | None, out: CertPaths) -> CertPaths:
    ca_cert, ca_key = _load_ca(directory)
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(days, not_before, not_after)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(ca_cert.subject)
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                            crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
               # serverAuth or clientAuth only: a client certificate cannot pose as the broker, nor the reverse.
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    write_atomically(out.key, _pem_key(key), 0o600)
    write_atomically(out.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return out


def mint_ca(directory: str | os.PathLike[str], *, common_name: str = "gpubroker CA", days: int = 3650,
            force: bool = False, not_before: dt.datetime | None = None,
            not_after: dt.datetime | None = None) -> CertPaths:
    """A self-signed CA in ``directory``; an existing one is kept unless ``force`` (replacing it orphans clients)."""
    directory = Path(directory)
    out = CertPaths(directory / "ca.pem", directory / "ca.key")
    _refuse_existing([out.cert, out.key], force)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = ec.generate_private_key(ec.SECP256R1())
    start, end = _validity(days, not_before, not_after)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (x509.CertificateBuilder()
            .subject_name(name).issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    write_atomically(out.key, _pem_key(key), 0o600)
    write_atomically(out.cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return out


def mint_server_cert(directory: str | os.PathLike[str], sans: Sequence[str] | None = None, *, days: int = 825,
                     not_before: dt.datetime | None = None, not_after: dt.datetime | None = None) -> CertPaths:
    """``server.pem`` / ``server.key`` signed by the CA in ``directory``; ``sans`` are DNS names or IP addresses."""
    directory = Path(directory)
    names = list(dict.fromkeys(sans or default_sans()))
    return _leaf(directory, names[0], [_san(n) for n in names], ExtendedKeyUsageOID.SERVER_AUTH, days, not_before,
                 not_after, CertPaths(directory / "server.pem", directory / "server.key"))


def mint_client_cert(directory: str | os.PathLike[str], name: str, *, uri: str | None = None, days: int = 365,
                     force: bool = False, not_before: dt.datetime | None = None,
                     not_after: dt.datetime | None = None) -> CertPaths:
    """``clients/NAME.pem`` / ``.key`` with CN = ``name`` and, given ``uri``, a SAN URI (e.g. spiffe://...)."""
    if not _NAME.match(name):
        raise InvalidArgument(f"client name {name!r} must be 1-64 of [A-Za-z0-9_.-]")
    if uri is not None and "://" not in uri:
        raise InvalidArgument(f"--uri {uri!r} is not a URI (scheme://...)")  # the broker maps only SANs with ://
    directory = Path(directory)
    out = CertPaths(directory / "clients" / f"{name}.pem", directory / "clients" / f"{name}.key")
    _refuse_existing([out.cert, out.key], force)
    sans: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri)] if uri else []
    return _leaf(directory, name, sans, ExtendedKeyUsageOID.CLIENT_AUTH, days, not_before, not_after, out)


def init_certs(directory: str | os.PathLike[str], sans: Sequence[str] | None = None, *, days: int = 825,
               force: bool = False) -> tuple[CertPaths, CertPaths]:
    """A CA and a server certificate in ``directory``: what `gpubroker certs init` writes."""
    ca = mint_ca(directory, force=force)
    return ca, mint_server_cert(directory, sans, days=days)


def tls_snippet(directory: str | os.PathLike[str], require_client_cert: bool = True) -> str:
    """The [tls] table that points a broker at ``directory``'s server certificate and CA."""
    d = Path(directory).resolve()
    return "\n".join([
        "[tls]",
        f'cert_file = "{d / "server.pem"}"',
        f'key_file = "{d / "server.key"}"',
        f'client_ca_file = "{d / "ca.pem"}"',
        f"require_client_cert = {'true' if require_client_cert else 'false'}",
        "allow_tokens = true  # false: on TLS listeners only a client certificate authenticates",
    ])
