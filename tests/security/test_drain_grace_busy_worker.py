"""A drain's grace ends a session whose worker is busy (issue 21, round 10: it did not).

Admin Drain (or SIGTERM with ``drain_grace_seconds``) promises that running sessions "may go on" for the grace and
are then ended. Ending one is a CloseSession request to its worker, which waits behind whatever the worker is
running; a lone tenant's device work may run for ``lone_kernel_seconds`` (600 s by default). So a tenant that
keeps its worker busy (one torch operator: ``aten::sum`` of a 4 Ti-element expanded view, minutes of CPU, no
memory) outlives the drain: measured on PoCL, 20 s after "drain grace over: ending 1 sessions still running" the
worker was still running (both CPUs), its session not closed, its client's call still waiting. The operator who
drained the broker for maintenance is left with a tenant's work running for as long as the tenant likes (only
SIGTERM's shutdown, which kills the workers, ends it: 6 s).

The fix: at the grace's end, a session whose worker does not close it within 5 s has its worker killed (charged to
nobody: a drain is nobody's failure), as the shutdown does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec, descendants
from gpubroker.client import GpuBrokerError, connect
from gpubroker.client._admin import AdminClient
from gpubroker.wire.torch import TensorArg, TorchOp

GRACE = 1.0
AFTER_GRACE = 12.0  # what the test allows the drain beyond its grace to end the session


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    # (no idle reap in the test's time: the worker must go because of the drain)
    with BrokerProcess([TenantSpec("mallory"), TenantSpec("ops", admin=True)], backend="opencl",
                       settings={"worker_idle_seconds": 600.0}) as b:
        yield b


def _workers(broker: BrokerProcess) -> list[int]:
    """The broker's workers and their sandbox launchers: its descendants but its acceptor process and the workers'
    zygote, which stay."""
    assert broker.process is not None
    found = []
    for pid in descendants(broker.process.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"gpubroker.broker.front._acceptor" not in cmdline and b"gpubroker.broker.zygote" not in cmdline:
                found.append(pid)
        except OSError:
            pass
    return found


def test_drain_grace_ends_a_busy_session(broker: BrokerProcess) -> None:
    assert broker.process is not None
    gpu = connect(broker.target, token=broker.tokens["mallory"], timeout=120)
    n = 1 << 42
    gpu.torch_op(TorchOp("aten::ones.default", [[1]], {}, ["one"], [("float32", (1,), (1,), 0)]))
    gpu.torch_op(TorchOp("aten::expand.default", [TensorArg("one"), [n]], {}, ["wide"], [("float32", (n,), (0,), 0)]))
    gpu.synchronize()
    workers = _workers(broker)
    assert workers, "no worker"
    gpu.torch_op(TorchOp("aten::sum.default", [TensorArg("wide")], {}, ["total"], [("float32", (), (), 0)]))
    ended: list[str] = []

    def wait_for_sum() -> None:
        try:
            gpu.torch_read("total")
            ended.append("finished")
        except GpuBrokerError as exc:
            ended.append(f"{type(exc).__name__}: {exc}")
    waiter = threading.Thread(target=wait_for_sum, daemon=True)
    waiter.start()
    waiter.join(1.0)  # (the sum is running)
    with AdminClient(broker.target, broker.tokens["ops"]) as admin:
        admin.drain(grace_seconds=GRACE)
    deadline = time.monotonic() + GRACE + AFTER_GRACE
    alive = workers
    while time.monotonic() < deadline:
        alive = [pid for pid in workers if pid in _workers(broker)]
        if not alive:
            break
        time.sleep(0.2)
    waiter.join(1.0)
    print(f"\n{GRACE + AFTER_GRACE:g} s after a drain of grace {GRACE:g} s: worker processes {alive} alive, "
          f"client's call {ended or 'still waiting'}")
    assert not alive, (f"the drain's grace ({GRACE:g} s) ended {AFTER_GRACE:g} s ago, and the busy tenant's worker "
                       f"{alive} still runs its session's work")
