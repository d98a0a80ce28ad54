"""Fixtures: real brokers in child processes on temp Unix sockets, on PoCL (default) or CUDA (-m cuda)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# scipy reads SCIPY_ARRAY_API once, at its first import, and scikit-learn's array_api_dispatch (the array
# namespace's library tests, `gpubroker bench arrays`) refuses to run without it. This file is imported before
# any test module, so no test that imports scipy early can leave it off for the rest of the session.
os.environ.setdefault("SCIPY_ARRAY_API", "1")
# grpcio is built with fork support, whose fork handlers make a fork() in a process holding gRPC channels wait for
# gRPC's threads: the tests that start an attacker as another uid (subprocess with user=, which must fork rather than
# vfork) then waited up to 62 s in fork, one run in two. No test uses gRPC in a forked child. (Read at grpc's import.)
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import pytest

from gpubroker.broker.config import TlsConfig
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import RemoteGpu, TlsOptions, connect

from .helpers import descendants

BACKENDS = [pytest.param("opencl", id="opencl"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]
TENANTS = [TenantSpec("alice", memory_quota=1 << 40), TenantSpec("bob", memory_quota=1 << 30),
           TenantSpec("carol", memory_quota=64 << 20)]


def _runs_module(cmdline: list[bytes], module: bytes) -> bool:
    """Whether a Python's command line runs ``module`` (its first ``-m``: a launcher's names the sandbox, then the
    worker's command line after it)."""
    return b"-m" in cmdline and cmdline[cmdline.index(b"-m") + 1:cmdline.index(b"-m") + 2] == [module]


def worker_pids(broker: BrokerProcess, tenant: str) -> list[int]:
    """Live worker processes of ``tenant`` under ``broker`` (found through /proc).

    The worker itself, not its sandbox launcher: with the sandbox on, a worker is the broker's grandchild (the
    launcher runs it as PID 1 of a PID namespace of its own), so this walks the broker's descendants.
    """
    assert broker.process is not None
    pids = []
    for pid in descendants(broker.process.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and _runs_module(cmdline, b"gpubroker.broker.worker") and tenant.encode() in cmdline:
            pids.append(pid)
    return pids


@pytest.fixture(scope="session", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# Every transport a client may take (as dask/distributed tests every Comm): the same-host ring (shared memory
# with doorbells, over a link), the same-host link (a Unix socket handed to the worker), the TCP link with TLS
# (relayed by the front to the worker), and gRPC.
TRANSPORTS = ["ring", "link", "tcp-tls", "grpc"]
_KIND = {"ring": "ring", "link": "unix", "tcp-tls": "tcp", "grpc": "grpc"}


@pytest.fixture(scope="session")
def server_tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[TlsConfig, TlsOptions]:
    """A CA and a server certificate: the shared broker's TLS settings and the client's options for them."""
    from gpubroker.broker.certs import init_certs  # cryptography: imported only where a test needs certificates

    ca, server = init_certs(tmp_path_factory.mktemp("ca"))
    return (TlsConfig(cert_file=str(server.cert), key_file=str(server.key)),
            TlsOptions(ca_file=ca.cert, server_name="localhost"))


@pytest.fixture(scope="session")
def broker(backend: str, server_tls: tuple[TlsConfig, TlsOptions]) -> Iterator[BrokerProcess]:
    """One broker shared by the read-mostly tests; tests that break things start their own. It serves every
    transport: gRPC and the same-host link on its Unix socket, gRPC and the link over TCP with TLS."""
    settings = {"lease_seconds": 30.0, "tls": server_tls[0], "link_listen": "127.0.0.1:0"}
    with BrokerProcess(TENANTS, backend=backend, tcp=["127.0.0.1:0"], settings=settings) as proc:
        yield proc
    assert proc.process is not None


OpenGpu = Callable[..., RemoteGpu]


@pytest.fixture(scope="session")
def open_gpu(broker: BrokerProcess, server_tls: tuple[TlsConfig, TlsOptions]) -> OpenGpu:
    """``open_gpu(tenant, transport, **connect_kwargs)``: a session on the shared broker over ``transport`` (one of
    TRANSPORTS), checked to have taken it."""

    def open_on(tenant: str, transport: str, **kwargs: Any) -> RemoteGpu:
        if transport == "tcp-tls":
            gpu = connect(broker.tcp_target, token=broker.tokens[tenant], tls=server_tls[1], transport="link",
                          **kwargs)
        else:
            gpu = connect(broker.target, token=broker.tokens[tenant], transport=transport, **kwargs)
        if gpu.transport.kind != _KIND[transport]:
            gpu.close()
            raise AssertionError(f"asked for {transport}, got {gpu.transport.kind}")
        return gpu

    return open_on


@pytest.fixture
def fresh_broker(backend: str) -> Iterator[BrokerProcess]:
    """A broker of this test's own, with a short lease so vanished clients are noticed quickly."""
    with BrokerProcess(TENANTS, backend=backend, settings={"lease_seconds": 1.0}) as proc:
        yield proc


@pytest.fixture(autouse=True)
def _no_proxy() -> None:
    # grpc honours http_proxy even for unix sockets on some builds; tests talk only to local brokers.
    for key in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY"):
        os.environ.pop(key, None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test shows the end of each of its brokers' logs (audit lines say why the front closed a connection,
    refused a call or killed a worker): a failure on CI, whose brokers are gone when it ends, can be read from the
    report alone."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if not report.failed or call.when == "teardown":
        return
    funcargs = getattr(item, "funcargs", {})
    brokers = {id(value): (name, value) for name, value in funcargs.items() if isinstance(value, BrokerProcess)}
    for name, proc in brokers.values():
        report.sections.append((f"broker log ({name}, its last 12 KB)", proc.log_tail(12_000)))
