"""TlsOptions: how a client reaches a broker's TCP listener (TLS, mTLS, or plaintext when told to)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ._errors import InvalidArgument

__all__ = ["TlsOptions"]


@dataclass(frozen=True)
class TlsOptions:
    """TLS for ``host:port`` targets. Files or bytes; bytes win when both are given.

    - ``ca_file`` / ``ca``: the CA that signed the broker's certificate (default: the system roots).
    - ``cert_file`` + ``key_file`` (or ``cert`` + ``key``): a client certificate, for brokers that require one; its
      CN or SAN URI names the tenant, so the token may then be ``None``.
    - ``server_name``: the name to check the broker's certificate against, when the target's host is not in it.
    - ``insecure``: plaintext TCP to a broker started with ``--insecure``; the token travels in the clear.
    """

    ca_file: str | os.PathLike[str] | None = None
    ca: bytes | None = None
    cert_file: str | os.PathLike[str] | None = None
    key_file: str | os.PathLike[str] | None = None
    cert: bytes | None = None
    key: bytes | None = None
    server_name: str | None = None
    insecure: bool = False

    def materials(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """(root CA, client key, client cert) as PEM bytes, read now so a missing file fails before connecting."""
        root = self.ca if self.ca is not None else _read(self.ca_file)
        key = self.key if self.key is not None else _read(self.key_file)
        cert = self.cert if self.cert is not None else _read(self.cert_file)
        if (key is None) != (cert is None):
            raise InvalidArgument("a client certificate needs both cert and key")
        return root, key, cert


def _read(path: str | os.PathLike[str] | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"{path}: {exc.strerror}") from None
