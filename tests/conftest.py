"""Fixtures: real brokers in child processes on temp Unix sockets, on PoCL (default) or CUDA (-m cuda)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec

from .helpers import descendants

BACKENDS = [pytest.param("opencl", id="opencl"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]
TENANTS = [TenantSpec("alice", memory_quota=1 << 40), TenantSpec("bob", memory_quota=1 << 30),
           TenantSpec("carol", memory_quota=64 << 20)]


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
        if state != "Z" and cmdline[1:3] == [b"-m", b"gpubroker.broker.workers"] and tenant.encode() in cmdline:
            pids.append(pid)
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
