"""The same-host link (``<socket>.fast``): the client's commands straight to its worker, with the front's
authentication, and results and errors identical to gRPC's."""

from __future__ import annotations

import socket
import warnings
from collections.abc import Iterator

import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.broker.certs import init_certs, mint_client_cert
from gpubroker.broker.config import TlsConfig
from gpubroker.broker.launcher import BrokerProcess
from gpubroker.client import (
    Buffer,
    InvalidArgument,
    Kernel,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    TlsOptions,
    Unauthenticated,
    Unavailable,
    connect,
)
from gpubroker.client._transports import BatchingTransport, framed_link, unix_connector
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.wire.commands import Batch, Synchronize, decode_ack, encode
from gpubroker.wire.frames import recv_payload, send_frame, send_payload
from gpubroker.wire.worker import MAX_LINKS_PER_SESSION

from ..conftest import TENANTS


def _link(broker: BrokerProcess, token: str, session: str) -> BatchingTransport:
    path = broker.target.removeprefix("unix:") + ".fast"
    return framed_link(unix_connector(path), token, session, kind="unix", timeout=10)


# "auto" takes the shared-memory ring on the same host; "link" the plain Unix link.
_KINDS = {"auto": "ring", "ring": "ring", "link": "unix", "grpc": "grpc"}


@pytest.mark.parametrize("transport", list(_KINDS))
def test_local_clients_take_the_link_with_the_same_results_and_errors(broker: BrokerProcess, transport: str) -> None:
    with connect(broker.target, token=broker.tokens["alice"], transport=transport) as gpu:
        assert gpu.transport.kind == _KINDS[transport]
        kernel = gpu.compile_kernel(samples.source(gpu.device_info().backend), "saxpy")
        n = 1000
        x = np.arange(n, dtype=np.float32)
        dx, dy = gpu.allocate_memory(x.nbytes), gpu.allocate_memory(x.nbytes)
        gpu.copy_h2d(x, dx)
        gpu.memset(dy, 0)
        gpu.copy_d2d(dx, dy, x.nbytes)  # y = x
        gpu.execute_kernel(kernel, (n + 127) // 128, 128, [np.float32(2), dx, dy, np.int32(n)])
        gpu.synchronize()
        out = np.empty_like(x)
        gpu.copy_d2h(dy, out)
        np.testing.assert_array_equal(out, 3 * x)
        with pytest.raises(InvalidArgument):  # errors come back the same way
            gpu.execute_kernel(kernel, 1, 128, [np.float32(2), dx])
        with pytest.raises(OutOfRange, match="past the end"):
            gpu.memset(Buffer(dx.handle, dx.size, x.nbytes + 1), 0, 1)
        with pytest.raises(NotFound, match="no kernel"):
            gpu.execute_kernel(Kernel("k_invented", "saxpy"), 1, 1, [np.float32(2), dx, dy, np.int32(n)])


def test_the_link_authenticates_like_the_front(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["alice"]) as alice:
        with pytest.raises(Unauthenticated, match="missing or invalid bearer token"):
            _link(broker, "gpb_nope_nope", alice.session)
        with pytest.raises(NotFound):  # bob may not drive alice's session, even knowing its id
            _link(broker, broker.tokens["bob"], alice.session)
        link = _link(broker, broker.tokens["alice"], alice.session)
        link.call(Synchronize())
        link.close()


def test_links_are_bound_to_their_session(broker: BrokerProcess) -> None:
    """A link serves only the session the front authenticated it for, even for the same tenant's other handles."""
    with connect(broker.target, token=broker.tokens["alice"]) as one, \
            connect(broker.target, token=broker.tokens["alice"]) as two:
        assert one.transport.kind == two.transport.kind == "ring"
        theirs = one.allocate_memory(64)
        with pytest.raises(NotFound, match="no buf"):
            two.memset(theirs, 1)
        one.memset(theirs, 1)
        one.synchronize()


def _bad_utf8() -> bytes:
    payload = bytearray(encode(Batch(1, 1, [Synchronize()])))
    payload[payload.index(b"synchronize") + 2] = 0xAD  # msgspec raised UnicodeDecodeError, which killed the worker
    return bytes(payload)


@pytest.mark.parametrize("payload", [encode(Batch(1, 1, [])) + b"\xc1", _bad_utf8()], ids=["trailing", "utf8"])
def test_a_malformed_frame_is_refused_with_id_0_and_the_link_closed(broker: BrokerProcess, payload: bytes) -> None:
    with connect(broker.target, token=broker.tokens["alice"]) as gpu:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(broker.target.removeprefix("unix:") + ".fast")
        send_frame(sock, {"token": broker.tokens["alice"], "session": gpu.session, "link": 1})
        recv_payload(sock, 1 << 16)  # the worker's hello reply
        send_payload(sock, payload)
        ack = decode_ack(recv_payload(sock, 1 << 16))
        assert ack.id == 0 and ack.error is not None and ack.error.code == "INVALID_ARGUMENT"
        assert sock.recv(1) == b""  # then closed
        sock.close()
        gpu.synchronize()  # the session's own link lived through it


def test_links_per_session_are_bounded(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["bob"]) as gpu:
        links = [_link(broker, broker.tokens["bob"], gpu.session) for _ in range(MAX_LINKS_PER_SESSION - 1)]
        with pytest.raises(ResourceExhausted, match="links"):  # the client's own is the first
            _link(broker, broker.tokens["bob"], gpu.session)
        for link in links:
            link.close()
    with connect(broker.target, token=broker.tokens["bob"], transport="link") as gpu:
        gpu.synchronize()


def test_an_ended_session_is_reported_by_the_front_not_as_a_lost_link(broker: BrokerProcess) -> None:
    for async_commands in (False, True):
        with connect(broker.target, token=broker.tokens["bob"], async_commands=async_commands) as gpu:
            assert gpu.transport.kind == "ring"
            gpu.synchronize()
            gpu._stub.CloseSession(pb.SessionRequest(session=gpu.session), metadata=gpu._metadata)  # ended elsewhere
            with pytest.raises(NotFound, match="session"):
                gpu.execute_kernel(Kernel("k_any", "x"), 1, 1, [])
                gpu.synchronize()


@pytest.fixture(scope="module")
def tls_broker(backend: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BrokerProcess, TlsOptions]]:
    """TCP with mutual TLS and a TCP link port, and no same-host link (``fast_path = false``)."""
    d = tmp_path_factory.mktemp("ca")
    ca, server = init_certs(d)
    alice = mint_client_cert(d, "alice")
    tls = TlsConfig(cert_file=str(server.cert), key_file=str(server.key), client_ca_file=str(ca.cert),
                    require_client_cert=True)
    settings = {"tls": tls, "link_listen": "127.0.0.1:0", "fast_path": False}
    with BrokerProcess(TENANTS, backend=backend, tcp=["127.0.0.1:0"], settings=settings) as proc:
        yield proc, TlsOptions(ca_file=ca.cert, cert_file=alice.cert, key_file=alice.key, server_name="localhost")


@pytest.mark.parametrize("transport", ["auto", "grpc"])
@pytest.mark.parametrize("async_commands", [False, True], ids=["sync", "async"])
def test_tcp_clients_take_the_tls_link_with_the_same_results_and_errors(
        tls_broker: tuple[BrokerProcess, TlsOptions], transport: str, async_commands: bool) -> None:
    broker, tls = tls_broker
    with connect(broker.tcp_target, tls=tls, transport=transport, async_commands=async_commands) as gpu:
        assert gpu.transport.kind == ("tcp" if transport == "auto" else "grpc")
        kernel = gpu.compile_kernel(samples.source(gpu.device_info().backend), "saxpy")
        size = 3 * gpu.chunk_bytes + 4099  # several chunks each way, and a short last one
        x = np.random.default_rng(1).random(size // 4, dtype=np.float32)
        dx, dy = gpu.allocate_memory(x.nbytes), gpu.allocate_memory(x.nbytes)
        gpu.copy_h2d(x, dx)
        gpu.memset(dy, 0)
        gpu.execute_kernel(kernel, (x.size + 127) // 128, 128, [np.float32(2), dx, dy, np.int32(x.size)])
        gpu.synchronize()
        out = np.empty_like(x)
        gpu.copy_d2h(dy, out)
        np.testing.assert_array_equal(out, np.float32(2) * x)
        with pytest.raises(InvalidArgument, match="saxpy"):  # at the launch, or deferred to the sync
            gpu.execute_kernel(kernel, 1, 128, [np.float32(2), dx])
            gpu.synchronize()


def test_where_the_broker_has_no_link_auto_takes_grpc_and_link_says_why(
        tls_broker: tuple[BrokerProcess, TlsOptions]) -> None:
    broker, _ = tls_broker
    token = broker.tokens["bob"]
    with connect(broker.target, token=token) as gpu:  # its "<socket>.fast" takes no links (segments only)
        assert gpu.transport.kind == "grpc"
        gpu.synchronize()
        # Host memory is shared all the same: segments registered on "<socket>.fast", CopyShared by gRPC.
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fallback to plain memory would warn
            host = gpu.host_array(4096, np.uint8)
        assert gpu._shm is not None and gpu._shm._arrays, "host_array fell back to plain memory"
        host[:] = np.arange(4096) % 251
        buf = gpu.allocate_memory(4096)
        gpu.copy_h2d(host, buf)
        back = gpu.host_array(4096, np.uint8)
        gpu.copy_d2h(buf, back)
        np.testing.assert_array_equal(back, host)
    with pytest.raises(Unavailable, match=r"no link to the broker's worker: unix: this broker serves no links"):
        connect(broker.target, token=token, transport="link")
