"""Addresses, parsed once: every listener, connector and peer string of gpubroker goes through `parse_address`.

The forms (the config reference's and gRPC's spellings):

- ``unix:PATH`` or ``unix://PATH`` (gRPC's form, so ``unix:///run/x.sock`` is ``/run/x.sock``): a Unix socket;
- ``vsock:CID:PORT``: a VM socket;
- ``HOST:PORT`` or ``[V6]:PORT``, optionally behind gRPC's ``dns:``, ``ipv4:`` or ``ipv6:`` scheme (``dns:///h:1``,
  ``ipv4:10.0.0.5:41234``, ``ipv6:[::1]:5000``, which is also how gRPC names a call's peer): TCP.

Errors are `AddressError` (a ValueError) whose message names the expected form; callers that owe their users an
error message of their own (the config, the client) keep it by catching this one.
"""

from __future__ import annotations

from typing import Final

import msgspec

__all__ = ["Address", "AddressError", "TcpAddress", "UnixAddress", "VsockAddress", "parse_address",
           "parse_host_port", "unix_path"]

_GRPC_SCHEMES: Final = ("dns:", "ipv4:", "ipv6:")
_PORT_MAX: Final = 65535


class AddressError(ValueError):
    """Text that names no address of the expected form."""


class UnixAddress(msgspec.Struct, frozen=True):
    """A Unix socket's path (relative paths as given)."""

    path: str

    def __str__(self) -> str:
        return f"unix:{self.path}"


class TcpAddress(msgspec.Struct, frozen=True):
    """A TCP endpoint: ``host`` without brackets (an IPv6 literal as ``::1``), ``port`` 0-65535."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class VsockAddress(msgspec.Struct, frozen=True):
    """A VM socket: the context id (2 = the host) and port."""

    cid: int
    port: int

    def __str__(self) -> str:
        return f"vsock:{self.cid}:{self.port}"


Address = UnixAddress | TcpAddress | VsockAddress


def parse_host_port(text: str, *, default_host: str = "", schemes: bool = False) -> TcpAddress:
    """``HOST:PORT`` or ``[V6]:PORT`` as a TcpAddress. ``schemes``: also take gRPC's target and peer forms
    (``dns:``, ``ipv4:``, ``ipv6:``, ``scheme://authority/``). ``default_host``: the host where the text names
    none (``:9464``); without one, a missing host is an error."""
    address = text.strip()
    if schemes:
        _scheme, sep, rest = address.partition("://")
        if sep:  # scheme://[authority]/HOST:PORT (dns:///host:443): what follows the authority
            address = rest.partition("/")[2] or rest
        for scheme in _GRPC_SCHEMES:
            address = address.removeprefix(scheme)
    host, sep, port = address.rpartition(":")
    host = host.strip("[]") or default_host
    if not sep or not host or not port.isdigit() or int(port) > _PORT_MAX:
        raise AddressError(f"expected HOST:PORT (e.g. 127.0.0.1:9464), got {text!r}")
    return TcpAddress(host, int(port))


def parse_address(text: str, *, default_host: str = "") -> Address:
    """The address ``text`` names, in any of the module's forms; AddressError (naming the form) if none."""
    path = unix_path(text)
    if path is not None:
        if not path:
            raise AddressError(f"expected unix:PATH, got {text!r}")
        return UnixAddress(path)
    if text.startswith("vsock:"):
        cid, sep, port = text[len("vsock:"):].partition(":")
        if not sep or not cid.isdigit() or not port.isdigit():
            raise AddressError(f"expected vsock:CID:PORT, got {text!r}")
        return VsockAddress(int(cid), int(port))
    return parse_host_port(text, default_host=default_host, schemes=True)


def unix_path(text: str) -> str | None:
    """The path of a ``unix:`` address (``""`` for a bare ``unix:``, which its user refuses in its own words);
    None for any other form."""
    if not text.startswith("unix:"):
        return None
    return text[len("unix://"):] if text.startswith("unix://") else text[len("unix:"):]
