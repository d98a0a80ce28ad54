"""Which transport a session gets: the best one the broker offers and the client can reach, chosen once."""

from __future__ import annotations

import logging
import socket
from collections.abc import Iterator
from typing import Final

from gpubroker.client._tls import TlsOptions
from gpubroker.client._transports._core import Transport
from gpubroker.client._transports._grpc import grpc_commands
from gpubroker.client._transports._link import (
    VMADDR_CID_HOST,
    Connector,
    framed_link,
    tcp_connector,
    unix_connector,
    vsock_connector,
)
from gpubroker.client._transports._ring import ring_transport
from gpubroker.v1 import broker_pb2_grpc as pb_grpc
from gpubroker.wire.addresses import AddressError, parse_host_port, unix_path
from gpubroker.wire.commands import CODECS
from gpubroker.wire.errors import GpuBrokerError, InvalidArgument, Unavailable

__all__ = ["TRANSPORTS", "choose_transport", "in_vm", "split_host_port"]

log = logging.getLogger("gpubroker.client")
TRANSPORTS: Final = ("auto", "ring", "link", "grpc")
_VSOCK_PROBE_SECONDS: Final = 0.2


def split_host_port(target: str) -> tuple[str, int]:
    """("host", port) of a gRPC target ``host:port`` or ``[v6]:port`` (with any ``dns:``/``ipv4:`` scheme)."""
    try:
        address = parse_host_port(target, default_host="localhost", schemes=True)
    except AddressError:
        raise InvalidArgument(f"cannot tell host and port from target {target!r}") from None
    return address.host, address.port


def in_vm(port: int) -> bool:
    """Whether this client runs in a VM guest whose host listens on vsock ``port`` (a short connect to CID 2)."""
    if not hasattr(socket, "AF_VSOCK"):
        return False
    try:
        vsock_connector(port, VMADDR_CID_HOST)(_VSOCK_PROBE_SECONDS).close()
    except OSError:
        return False
    return True


def choose_transport(preference: str, *, target: str, tls: TlsOptions | None, token: str, session: str,
                     link_port: int, link_vsock_port: int, vsock: bool | None, stub: pb_grpc.GpuBrokerStub,
                     metadata: tuple[tuple[str, str], ...], timeout: float | None, max_data: int,
                     compress: str | None = None) -> Transport:
    """``preference``: "link" (a framed link or Unavailable naming why each failed), "ring" (the same host's link
    upgraded to a shared-memory ring, or Unavailable), "grpc", or "auto" (the ring where the worker takes the
    upgrade, else a link where one answers: the same host's ``<socket>.fast``, the host's vsock port from a VM,
    the broker's TCP link port; else gRPC).

    ``compress``: None (copies' bytes as they are), "lz4" (asked on any link), or "auto" (lz4 on TCP and vsock
    links only: on the same host, shared memory and Unix sockets move bytes faster than lz4 packs them)."""
    if preference not in TRANSPORTS:
        raise InvalidArgument(f"transport must be one of {', '.join(TRANSPORTS)}, got {preference!r}")
    if compress not in (None, "auto", *CODECS):
        raise InvalidArgument(f"compress must be None, 'auto' or one of {', '.join(CODECS)}, got {compress!r}")
    if preference == "grpc":
        return grpc_commands(stub, metadata, session, max_data=max_data, timeout=timeout)
    path = unix_path(target)
    unix = path is not None
    if preference == "ring" and not unix:
        raise Unavailable(f"a shared-memory ring needs a broker on this host (a unix: target), not {target!r}")

    def candidates() -> Iterator[tuple[str, Connector]]:  # lazily: a VM probe only where nothing nearer answers
        if unix:
            yield "unix", unix_connector(f"{path}.fast")
        if link_vsock_port and (vsock if vsock is not None else in_vm(link_vsock_port)):
            yield "vsock", vsock_connector(link_vsock_port)
        if link_port and not unix:
            yield "tcp", tcp_connector(split_host_port(target)[0], link_port, tls)

    failures = []
    for kind, connect in candidates():
        try:
            if kind == "unix" and preference != "link":  # the same host: a ring where the worker takes one
                return ring_transport(connect, token, session, timeout=timeout, fallback=preference == "auto")
            codec = ("lz4" if kind in ("tcp", "vsock") else "") if compress == "auto" else compress or ""
            return framed_link(connect, token, session, kind=kind, timeout=timeout, compress=codec)
        except GpuBrokerError as exc:
            failures.append(f"{kind}: {exc.message}")
    if preference in ("link", "ring"):
        raise Unavailable("no link to the broker's worker: " + ("; ".join(failures) or "the broker offers none"))
    if failures:
        log.debug("no link to the broker's worker (%s); commands go by gRPC", "; ".join(failures))
    return grpc_commands(stub, metadata, session, max_data=max_data, timeout=timeout)
