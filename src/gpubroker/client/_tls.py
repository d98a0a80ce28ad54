"""TlsOptions: how a client reaches a broker's TCP listener (TLS, mTLS, or plaintext when told to)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from gpubroker.wire.errors import InvalidArgument

__all__ = ["TlsOptions"]


@dataclass(frozen=True)
class TlsOptions:
    """TLS for ``host:port`` targets. Files or bytes; bytes win when both are given.

    - ``ca_file`` / ``ca``: the CA that signed the broker's certificate (default: the system roots).
    - ``cert_file`` + ``key_file`` (or ``cert`` + ``key``): a client certificate, for brokers that require one; its
      CN or SAN URI names the tenant, so the token may then be ``None``.
    - ``server_name``: the name to check the broker's certificate against, when the target's host is not in it.
    - ``insecure``: plaintext TCP to a broker started with ``--insecure``; the token travels in the clear.

    Pass it as `connect(target, token, tls=TlsOptions(...))` (also to `list_devices` and `AdminClient`). It does
    not apply to `unix:` targets. A certificate that does not verify fails the connection with `Unavailable`.
    """

    ca_file: str | os.PathLike[str] | None = None
    """A PEM file with the CA certificate(s) that signed the broker's certificate; None: the system's roots."""
    ca: bytes | None = None
    """The same CA certificate(s) as PEM bytes."""
    cert_file: str | os.PathLike[str] | None = None
    """A PEM file with the client's certificate (mTLS); needs a key."""
    key_file: str | os.PathLike[str] | None = None
    """A PEM file with the client certificate's private key."""
    cert: bytes | None = None
    """The client's certificate as PEM bytes."""
    key: bytes | None = None
    """The client certificate's private key as PEM bytes."""
    server_name: str | None = None
    """The name the broker's certificate must carry, when it is not the target's host (an address, say)."""
    insecure: bool = False
    """Plaintext TCP, for a broker started with `--insecure` (loopback or a trusted network only)."""

    def materials(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        """(root CA, client key, client cert) as PEM bytes, read now so a missing file fails before connecting.

        Returns:
            The root CA, the client key and the client certificate, each None where not given.

        Raises:
            InvalidArgument: a file cannot be read, or a client certificate without its key (or a key without
                its certificate).
        """
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
