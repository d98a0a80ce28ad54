"""Links that poll for answers: where the broker's host has CPUs to spare, a link's worker polls for the client's
next batch after answering one, a TCP link's relay process polls for the next bytes each way, and the client polls
for the answer to its last batch (wire/ring.py), as the shared-memory ring's two sides do. Here every side spins
(SPIN_ENV, set for the broker and for this process) even on a host of two CPUs, where none would by default."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.broker.certs import init_certs
from gpubroker.broker.config import TlsConfig
from gpubroker.broker.launcher import BrokerProcess
from gpubroker.client import DeadlineExceeded, InvalidArgument, RemoteGpu, TlsOptions, connect
from gpubroker.client._transports import _link, _ring
from gpubroker.wire.ring import MAX_SPIN_US, SPIN_ENV, link_spin_us

from ..conftest import TENANTS
from ..helpers import busy_synchronizing, other_tenants_launches_take, spin_iterations

_SPIN_US = "200"  # (the longest: a synchronous client's next batch comes within it even on a slow CI host)


@pytest.fixture(scope="module")
def spinning_broker(backend: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BrokerProcess,
                                                                                              TlsOptions]]:
    d = tmp_path_factory.mktemp("ca")
    ca, server = init_certs(d)
    settings = {"tls": TlsConfig(cert_file=str(server.cert), key_file=str(server.key)),
                "link_listen": "127.0.0.1:0", "link_tls_processes": 1, "lease_seconds": 30.0}
    with BrokerProcess(TENANTS, backend=backend, tcp=["127.0.0.1:0"], settings=settings,
                       env={SPIN_ENV: _SPIN_US}) as proc:
        yield proc, TlsOptions(ca_file=ca.cert, server_name="localhost")


@pytest.fixture(autouse=True)
def _client_spins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPIN_ENV, _SPIN_US)


def _connect(broker: BrokerProcess, tls: TlsOptions, kind: str, token: str = "alice", **kwargs: Any) -> RemoteGpu:
    if kind == "tcp":
        gpu = connect(broker.tcp_target, token=broker.tokens[token], tls=tls, transport="link", **kwargs)
    else:
        gpu = connect(broker.target, token=broker.tokens[token], transport="ring" if kind == "ring" else "link",
                      shared_memory=False, **kwargs)
    assert gpu.transport.kind == kind
    return gpu


def test_a_tcp_links_worker_and_relay_poll_longest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A TCP link's next batch comes later after an answer (its relay's hop, TLS both ways): its worker and relay
    poll MAX_SPIN_US where the host spins at all; SPIN_ENV, where set, is every side's spin."""
    monkeypatch.delenv(SPIN_ENV)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert link_spin_us(relayed=True) == MAX_SPIN_US > link_spin_us(relayed=False) > 0
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert link_spin_us(relayed=True) == link_spin_us(relayed=False) == 0
    monkeypatch.setenv(SPIN_ENV, "30")
    assert link_spin_us(relayed=True) == link_spin_us(relayed=False) == 30


@pytest.mark.parametrize("async_commands", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("kind", ["unix", "tcp"])
def test_results_through_links_that_poll(spinning_broker: tuple[BrokerProcess, TlsOptions], kind: str,
                                         async_commands: bool) -> None:
    """Dependent kernels and reads back over many round trips, a copy of several frames each way (striped over
    TCP links), and an error, through a link whose every side polls."""
    broker, tls = spinning_broker
    with _connect(broker, tls, kind, async_commands=async_commands) as gpu:
        kernel = gpu.compile_kernel(samples.source(gpu.device_info().backend), "scale_inplace")
        n = 3 * gpu.chunk_bytes // 4 + 1025  # several frames each way, and a short last one
        x = np.arange(n, dtype=np.float32)
        buf = gpu.allocate_memory(x.nbytes)
        gpu.copy_h2d(x, buf)
        out = np.empty_like(x)
        for i in range(4):
            gpu.execute_kernel(kernel, (n + 255) // 256, 256, [buf, np.float32(-1), np.int32(n)])
            gpu.copy_d2h(buf, out)
            np.testing.assert_array_equal(out, x if i % 2 else 1 - x)
        for _ in range(200):
            gpu.execute_kernel(kernel, 1, 1, [buf, np.float32(1), np.int32(1)])
            gpu.synchronize()
        gpu.copy_d2h(buf, out)
        assert out[0] == 200 and out[1] == 1  # (x[0] = 0, plus 1 at each launch; the rest untouched)
        with pytest.raises(InvalidArgument):  # an error comes back the same way
            gpu.execute_kernel(kernel, 1, 1, [buf])
            gpu.synchronize()
        gpu.synchronize()


def test_a_worker_polling_its_link_still_serves_the_tenants_ring(
        spinning_broker: tuple[BrokerProcess, TlsOptions]) -> None:
    """A client whose next batch always comes within the worker's poll keeps its worker polling; a ring of the
    same tenant's (same worker), whose client rings no doorbell while that worker's loop runs, is looked at
    meanwhile: its calls are answered while the link's client goes on."""
    broker, tls = spinning_broker
    with _connect(broker, tls, "unix", timeout=20) as link, busy_synchronizing(link) as counts:
        with _connect(broker, tls, "ring", timeout=20) as ring:
            start = counts[0]
            for _ in range(100):
                ring.synchronize()
        assert counts[0] > start, "the link's client stopped meanwhile: this test shows nothing"


@pytest.mark.parametrize("kind", ["unix", "tcp"])
def test_a_polling_link_does_not_keep_the_device_from_another_tenant(
        spinning_broker: tuple[BrokerProcess, TlsOptions], kind: str) -> None:
    """The worker polls only while its turn is uncontended: another tenant that wants the device gets its turns
    while the first tenant's link goes on."""
    broker, tls = spinning_broker
    with _connect(broker, tls, kind, timeout=20) as alice, busy_synchronizing(alice) as counts:
        with connect(broker.target, token=broker.tokens["bob"], transport="grpc", timeout=20) as bob:
            start = counts[0]
            took = other_tenants_launches_take(bob)
        assert counts[0] > start, "alice stopped while bob ran: this test shows nothing"
        assert took < 10, f"bob's 20 launches took {took:.1f} s beside a polling link"


@pytest.mark.parametrize("kind", ["ring", "unix", "tcp"])
def test_a_calls_own_timeout_bounds_its_poll(spinning_broker: tuple[BrokerProcess, TlsOptions], backend: str,
                                             kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client polls for its answer (here up to 0.5 s) within the call's own bound: a synchronize(timeout=0.1)
    of work that runs on gives its DeadlineExceeded after about 0.1 s, not after the poll, and the session goes
    on."""
    for module in (_link, _ring):
        monkeypatch.setattr(module, "wait_spin_us", lambda: 500_000)
    broker, tls = spinning_broker
    with _connect(broker, tls, kind) as gpu:
        kernel, buf = gpu.compile_kernel(samples.source(backend), "spin"), gpu.allocate_memory(4096)
        iters = spin_iterations(gpu, kernel, buf, seconds=1.5)
        gpu.execute_kernel(kernel, 1, 1, [buf, np.int64(iters)])
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            gpu.synchronize(timeout=0.1)
        took = time.monotonic() - start
        assert 0.1 <= took < 0.4, took
        gpu.synchronize(timeout=60)
