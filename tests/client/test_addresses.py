"""wire/addresses: every address form of gpubroker parsed in one place, with errors that name the form."""

from __future__ import annotations

import pytest

from gpubroker.wire.addresses import (
    AddressError,
    TcpAddress,
    UnixAddress,
    VsockAddress,
    parse_address,
    parse_host_port,
    unix_path,
)


@pytest.mark.parametrize(("text", "address"), [
    ("unix:/run/gpubroker/gpubroker.sock", UnixAddress("/run/gpubroker/gpubroker.sock")),
    ("unix:///run/x.sock", UnixAddress("/run/x.sock")),
    ("unix:relative.sock", UnixAddress("relative.sock")),
    ("vsock:2:7070", VsockAddress(2, 7070)),
    ("127.0.0.1:50051", TcpAddress("127.0.0.1", 50051)),
    ("[::1]:9464", TcpAddress("::1", 9464)),
    ("dns:///gpu-host.example:443", TcpAddress("gpu-host.example", 443)),
    ("dns:gpu-host.example:443", TcpAddress("gpu-host.example", 443)),
    ("ipv4:10.0.0.5:41234", TcpAddress("10.0.0.5", 41234)),
    ("ipv6:[::ffff:10.0.0.5]:41234", TcpAddress("::ffff:10.0.0.5", 41234)),
])
def test_parse_address_forms(text: str, address: UnixAddress | TcpAddress | VsockAddress) -> None:
    assert parse_address(text) == address


@pytest.mark.parametrize(("address", "text"), [
    (UnixAddress("/a.sock"), "unix:/a.sock"),
    (TcpAddress("::1", 1), "[::1]:1"),
    (TcpAddress("localhost", 0), "localhost:0"),
    (VsockAddress(3, 5), "vsock:3:5"),
])
def test_addresses_print_as_parsed(address: UnixAddress | TcpAddress | VsockAddress, text: str) -> None:
    assert str(address) == text and parse_address(text) == address


@pytest.mark.parametrize(("text", "expected"), [
    ("unix:", "expected unix:PATH"),
    ("vsock:2", "expected vsock:CID:PORT"),
    ("vsock:x:1", "expected vsock:CID:PORT"),
    ("gpu-host", "expected HOST:PORT"),
    (":9464", "expected HOST:PORT"),
    ("host:65536", "expected HOST:PORT"),
    ("host:-1", "expected HOST:PORT"),
])
def test_parse_address_errors_name_the_form(text: str, expected: str) -> None:
    with pytest.raises(AddressError, match=expected) as info:
        parse_address(text)
    assert isinstance(info.value, ValueError) and repr(text) in str(info.value)


def test_host_port_schemes_and_default_host() -> None:
    assert parse_host_port(":80", default_host="localhost") == TcpAddress("localhost", 80)
    assert parse_host_port("dns:///h:1", schemes=True) == TcpAddress("h", 1)


def test_unix_path() -> None:
    assert unix_path("unix:/a") == "/a" and unix_path("unix:///a") == "/a" and unix_path("unix:") == ""
    assert unix_path("127.0.0.1:1") is None and unix_path("vsock:2:1") is None
