"""Large copies over the TCP link (TLS), striped over several links of the session: results byte-identical,
program order kept with the commands queued before and after, and a failing chunk's error raised by the copy."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from gpubroker.broker.certs import init_certs
from gpubroker.broker.config import TlsConfig
from gpubroker.broker.launcher import BrokerProcess
from gpubroker.client import NotFound, TlsOptions, connect
from gpubroker.client._transports import BatchingTransport
from gpubroker.client._transports._link import STRIPE_MIN, TCP_STRIPES
from gpubroker.wire.commands import Batch, Write, encode

from ..conftest import TENANTS


@pytest.fixture(scope="module")
def tls_broker(backend: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BrokerProcess, TlsOptions]]:
    d = tmp_path_factory.mktemp("ca")
    ca, server = init_certs(d)
    settings = {"tls": TlsConfig(cert_file=str(server.cert), key_file=str(server.key)),
                "link_listen": "127.0.0.1:0", "fast_path": False}
    with BrokerProcess(TENANTS, backend=backend, tcp=["127.0.0.1:0"], settings=settings) as proc:
        yield proc, TlsOptions(ca_file=ca.cert, server_name="localhost")


def test_a_large_copy_is_striped_in_program_order(tls_broker: tuple[BrokerProcess, TlsOptions]) -> None:
    broker, tls = tls_broker
    size = 2 * STRIPE_MIN + 12345  # several chunks on every link, and a short last one
    data = np.random.default_rng(3).integers(0, 256, size, dtype=np.uint8)
    with connect(broker.tcp_target, token=broker.tokens["alice"], tls=tls, async_commands=True) as gpu:
        link = gpu.transport
        assert isinstance(link, BatchingTransport) and link.kind == "tcp" and link.stripes is not None
        link.stripes.count = TCP_STRIPES  # (what a host of 8 cores or more takes; this one may have fewer)
        buf = gpu.allocate_memory(size + 4096)
        gpu.memset(buf, 7)  # queued: must have run before the copy's chunks land
        gpu.copy_h2d(data, buf, offset=4096)
        gpu.memset(buf, 9, size=100, offset=4096)  # after the copy, over its first bytes
        out = np.empty(size + 4096, np.uint8)
        gpu.copy_d2h(buf, out)
        assert len(link._more) == TCP_STRIPES - 1  # (it did go over several links)
        expected = np.concatenate([np.full(4096, 7, np.uint8), data])
        expected[4096:4196] = 9
        np.testing.assert_array_equal(out, expected)


def test_a_striped_copy_raises_its_error_and_the_link_goes_on(tls_broker: tuple[BrokerProcess, TlsOptions]) -> None:
    broker, tls = tls_broker
    size = STRIPE_MIN
    with connect(broker.tcp_target, token=broker.tokens["alice"], tls=tls, async_commands=True) as gpu:
        assert isinstance(gpu.transport, BatchingTransport) and gpu.transport.stripes is not None
        gpu.transport.stripes.count = TCP_STRIPES
        gone = gpu.allocate_memory(size)
        gpu.free_memory(gone)  # queued: the copy's chunks come after it
        with pytest.raises(NotFound, match="buf"):
            gpu.copy_h2d(np.zeros(size, np.uint8), gone)
        with pytest.raises(NotFound, match="buf"):
            gpu.copy_d2h(gone, np.empty(size, np.uint8))
        kept = gpu.allocate_memory(size)
        data = np.arange(size, dtype=np.uint32).view(np.uint8)[:size]
        gpu.copy_h2d(data, kept)
        out = np.empty(size, np.uint8)
        gpu.copy_d2h(kept, out)
        np.testing.assert_array_equal(out, data)
        gpu.synchronize()


def test_a_frame_that_ends_on_a_full_tls_record_is_relayed(tls_broker: tuple[BrokerProcess, TlsOptions]) -> None:
    """The front's relay gathers full TLS records before writing them to the worker, taking a short one as a frame's
    end: a frame whose records are all full must still go on (after the relay's short linger)."""
    broker, tls = tls_broker
    # (a frame held for good would fail its ack's wait: DeadlineExceeded)
    with connect(broker.tcp_target, token=broker.tokens["alice"], tls=tls, timeout=30) as gpu:
        link = gpu.transport
        assert isinstance(link, BatchingTransport) and link.kind == "tcp"
        buf = gpu.allocate_memory(1 << 20)
        gpu.synchronize()
        record, header = 16 * 1024, 4
        for _ in range(3):  # (ids and sequence numbers stay small ints: one byte each, as in the estimate)
            probe = bytes(70_000)  # (a payload as long in msgpack's terms: a bin32)
            overhead = len(encode(Batch(link._next_id, link._seq + 1, [Write((buf.handle, 0), 0, probe, "")])))
            overhead -= len(probe)
            size = 6 * record - header - overhead  # the frame: header + payload, exactly six full records
            data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
            link.call(Write((buf.handle, 0), 0, data, ""))
            out = np.empty(size, np.uint8)
            gpu.copy_d2h(buf, out)
            assert out.tobytes() == data
