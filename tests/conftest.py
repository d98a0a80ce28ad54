"""Fixtures: real brokers in child processes on temp Unix sockets, on PoCL (default) or CUDA (-m cuda)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec

BACKENDS = [pytest.param("opencl", id="opencl"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]
TENANTS = [TenantSpec("alice", memory_quota=1 << 40), TenantSpec("bob", memory_quota=1 << 30),
           TenantSpec("carol", memory_quota=64 << 20)]


def worker_pids(broker: BrokerProcess, tenant: str) -> list[int]:
    """Live worker processes of ``tenant`` under ``broker`` (found through /proc)."""
    assert broker.process is not None
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        state = stat.rsplit(")", 1)[1].split()[0]
        if (ppid == broker.process.pid and state != "Z" and b"gpubroker.broker.workers" in cmdline
                and tenant.encode() in cmdline):
            pids.append(int(entry.name))
    return pids


@pytest.fixture(scope="session", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def broker(backend: str) -> Iterator[BrokerProcess]:
    """One broker shared by the read-mostly tests; tests that break things start their own."""
    with BrokerProcess(TENANTS, backend=backend, settings={"lease_seconds": 30.0}) as proc:
        yield proc
    assert proc.process is not None


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
