"""Credentials for the broker's TCP listeners: TLS (or mTLS) when configured, local credentials on loopback; the
same for the TCP link listener (link_listen), as an ssl context."""

from __future__ import annotations

import ipaddress
import logging
import ssl
from pathlib import Path
from typing import NamedTuple

import grpc

from gpubroker.broker.config import BrokerConfig
from gpubroker.broker.front._tls_relays import server_context
from gpubroker.wire.addresses import AddressError, parse_host_port, unix_path
from gpubroker.wire.errors import FailedPrecondition, InvalidArgument
from gpubroker.wire.tls_relay import Serve

__all__ = ["LinkTls", "check_listeners", "link_tls_material", "tcp_credentials"]

log = logging.getLogger("gpubroker.server")


def loopback_address(address: str) -> bool:
    """Whether a listen address ``HOST:PORT`` names a loopback host; InvalidArgument (``listen: ...``) for text
    that is no HOST:PORT, as the listener itself would say."""
    try:
        return _is_loopback(parse_host_port(address).host)
    except AddressError as exc:
        raise InvalidArgument(f"listen: {exc}") from None


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


def _check_tls(cfg: BrokerConfig) -> None:
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


def tcp_credentials(cfg: BrokerConfig, address: str) -> grpc.ServerCredentials:
    """TLS on every TCP listener when [tls] is set; else local credentials on loopback, plaintext only if insecure."""
    tls = cfg.tls
    if tls is not None:
        _check_tls(cfg)
        client_ca = _read_tls_file(cfg, "client_ca_file") if tls.require_client_cert else None
        return grpc.ssl_server_credentials([(_read_tls_file(cfg, "key_file"), _read_tls_file(cfg, "cert_file"))],
                                           root_certificates=client_ca, require_client_auth=tls.require_client_cert)
    if loopback_address(address):
        return grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    if cfg.insecure:
        log.warning("plaintext TCP on %s (insecure = true): tokens travel in the clear; configure [tls]", address)
        return grpc.insecure_server_credentials()
    raise FailedPrecondition(f"refusing plaintext TCP on non-loopback {address}: configure [tls] "
                             "(see `gpubroker certs init`) or pass --insecure")


def link_tls_material(cfg: BrokerConfig, address: str) -> Serve | None:
    """The TCP link's TLS: the gRPC listeners' certificate, key and (mTLS) client CA, read now; None for
    plaintext, which only loopback or ``insecure`` allows, as for gRPC."""
    tls = cfg.tls
    if tls is None:
        if not loopback_address(address):
            if not cfg.insecure:
                raise FailedPrecondition(f"refusing a plaintext link on non-loopback {address}: configure [tls] "
                                         "or pass --insecure")
            log.warning("plaintext link on %s (insecure = true): tokens travel in the clear; configure [tls]",
                        address)
        return None
    _check_tls(cfg)
    client_ca = _read_tls_file(cfg, "client_ca_file") if tls.require_client_cert else None
    return Serve(_read_tls_file(cfg, "cert_file"), _read_tls_file(cfg, "key_file"), client_ca)


class LinkTls(NamedTuple):
    """The TCP link's TLS, read once: what the TLS relay processes serve with, and the same as the context the
    front's own relay threads serve with (building it checks the files hold a usable certificate and key)."""

    material: Serve
    context: ssl.SSLContext


def check_listeners(cfg: BrokerConfig) -> tuple[dict[str, grpc.ServerCredentials], LinkTls | None]:
    """What a broker serving ``cfg`` listens with, checked before anything slow (the device probe) and by
    `gpubroker config check`: each TCP listener's credentials (TLS files readable, plaintext only on loopback
    unless insecure), the TCP link's TLS (its files read once), a Unix listener for vsock to relay to.
    FailedPrecondition or InvalidArgument naming the key otherwise."""
    tcp = {a: tcp_credentials(cfg, a) for a in cfg.listen if unix_path(a) is None}
    material = link_tls_material(cfg, cfg.link_listen) if cfg.link_listen else None
    link = LinkTls(material, server_context(material)) if material is not None else None
    if cfg.vsock_port and not any(unix_path(a) is not None for a in cfg.listen):
        raise FailedPrecondition("vsock_port relays to the broker's own Unix socket: add a unix: listener")
    return tcp, link
