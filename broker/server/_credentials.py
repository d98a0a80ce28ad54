"""Credentials for the broker's TCP listeners: TLS (or mTLS) when configured, local credentials on loopback."""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path

import grpc

from gpubroker.client import FailedPrecondition

from ..config import BrokerConfig

__all__ = ["tcp_credentials"]

log = logging.getLogger("gpubroker.server")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost may resolve anywhere


def _read_tls_file(cfg: BrokerConfig, key: str) -> bytes:
    name = getattr(cfg.tls, key)
    if not name:
        raise FailedPrecondition(f"[tls] {key} is not set")
    path = Path(name)
    if not path.is_absolute() and cfg.path is not None:
        path = cfg.path.parent / path  # relative paths are relative to the config file, not the cwd
    try:
        return path.read_bytes()
    except OSError as exc:
        raise FailedPrecondition(f"[tls] {key} {path}: {exc.strerror}") from None


def tcp_credentials(cfg: BrokerConfig, address: str) -> grpc.ServerCredentials:
    """TLS on every TCP listener when [tls] is set; else local credentials on loopback, plaintext only if insecure."""
    tls = cfg.tls
    if tls is not None:
        if tls.require_client_cert and not tls.client_ca_file:
            raise FailedPrecondition("[tls] require_client_cert needs client_ca_file (the CA that signs clients)")
        if not tls.allow_tokens and not tls.require_client_cert:
            raise FailedPrecondition("[tls] allow_tokens = false needs require_client_cert = true: "
                                     "otherwise no TCP client could authenticate")
        # Python gRPC either requires a verified client certificate or asks for none at all: with
        # require_client_cert off, TCP clients authenticate by token only and client_ca_file goes unused.
        if tls.client_ca_file and not tls.require_client_cert:
            log.warning("[tls] client_ca_file is set but require_client_cert is false: client certificates "
                        "are not requested, so TCP clients authenticate by token only")
        client_ca = _read_tls_file(cfg, "client_ca_file") if tls.require_client_cert else None
        return grpc.ssl_server_credentials([(_read_tls_file(cfg, "key_file"), _read_tls_file(cfg, "cert_file"))],
                                           root_certificates=client_ca, require_client_auth=tls.require_client_cert)
    if _is_loopback(address.rsplit(":", 1)[0].strip("[]")):
        return grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    if cfg.insecure:
        log.warning("plaintext TCP on %s (insecure = true): tokens travel in the clear; configure [tls]", address)
        return grpc.insecure_server_credentials()
    raise FailedPrecondition(f"refusing plaintext TCP on non-loopback {address}: configure [tls] "
                             "(see `gpubroker certs init`) or pass --insecure")
