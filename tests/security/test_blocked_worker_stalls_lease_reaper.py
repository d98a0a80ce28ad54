"""One tenant's blocked worker stops the lease reaper for every tenant: another tenant's expired sessions are never
ended, and it is locked out of new ones.

The hole: the front's lease reaper (``SessionManager._reap_loop``, front/_sessions.py) ends each expired session in
turn with ``await self.close(session)``, which asks the session's worker to close it (``CloseSession``) and waits
for the answer, with no timeout. A worker answers the front only between the commands it runs, and a tenant can
keep its worker inside one for as long as it likes: a kernel that sleeps (``nanosleep``: no CPU) and then a
``synchronize``, on a device where nobody else waits (``lone_kernel_seconds``: 600 s by default). Once that
tenant's session expires (its client stops heartbeating: the synchronize on the link does not renew the lease), the
reaper waits on that worker for as long as the kernel lasts, and reaps nothing else: every other tenant's expired
session keeps its device memory, its place in ``max_sessions_per_tenant`` and its worker.

The attack: mallory launches a kernel that sleeps for minutes, synchronizes, and stops heartbeating. bob (with
``max_sessions_per_tenant`` = 1) has a session whose client then dies (stops heartbeating), and opens a new one once
the old one's lease (2 s) is long past.

Measured (2-core VM, PoCL, lease_seconds = 2): mallory's session expired but was never logged as ended; bob's dead
session was still listed 15 s after its last heartbeat (7 leases), and bob's new session was refused with
RESOURCE_EXHAUSTED ("1 sessions, the limit") throughout, for as long as mallory's kernel sleeps.

Suggested fix: the reaper must never wait on a tenant's worker: end each expired session in a task of its own (or
forget it at once and let the worker's close follow), and bound every call the front makes to a worker on behalf of
someone else (``asyncio.wait_for``, then kill the worker, charged to its tenant). See also
test_blocked_worker_stalls_reload.py, the same pattern in the reload.

The fix (front/_sessions.py): a session ended on behalf of someone other than its client (the reaper, an admin, a
drain, the broker's stop: ``SessionManager.end``) leaves the list, and its tenant's count, at once; its worker is asked
to close it in a task of its own. Idle workers are stopped in tasks too, and the broker's stop gives the closes and
the workers' exits one grace, then kills what is left (the last test here).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import AdminClient, GpuBrokerError, RemoteGpu, ResourceExhausted, connect

from ..conftest import worker_pids
from ..helpers import wait_for
from ._probes import waits_on_its_kernel
from .exploits import SYSCALL_SOURCE, check_arch

SLEEP_SOURCE = SYSCALL_SOURCE + r"""
__kernel void gpb_sleep(__global long* out, const long seconds) {
    long ts[2] = {1, 0};
    for (long i = 0; i < seconds; ++i) out[0] = sys6(35, (long)ts, 0, 0, 0, 0, 0);   /* nanosleep(1 s) */
}
"""
SLEEP = 150  # seconds: longer than the test; the test kills the worker at its end
LEASE = 2.0
GRACE = 15.0  # how long after bob's last heartbeat the test waits for his session to be reaped
STOP_BOUND = 30.0  # seconds: the stop's grace (5 s, the sessions' closes and the workers' exits), and room


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    check_arch()
    tenants = [TenantSpec("ops", admin=True), TenantSpec("mallory"), TenantSpec("bob"), TenantSpec("erin")]
    # (a drain that ends nobody's session before the last test's second SIGTERM cuts it short)
    settings: dict[str, object] = {"lease_seconds": LEASE, "max_sessions_per_tenant": 1, "drain_grace_seconds": 600.0}
    with BrokerProcess(tenants, backend="opencl", settings=settings) as proc:
        yield proc


def _block(gpu: RemoteGpu, pid: int) -> None:
    """The tenant's worker ``pid`` runs a kernel that sleeps for SLEEP seconds, and waits for it (synchronize)."""
    kernel = gpu.compile_kernel(SLEEP_SOURCE, "gpb_sleep")
    out = gpu.allocate_memory(64)
    gpu.execute_kernel(kernel, 1, 1, [out, np.int64(SLEEP)])

    def block() -> None:
        try:
            gpu.synchronize()
        except GpuBrokerError:
            pass

    threading.Thread(target=block, daemon=True).start()
    wait_for(lambda: waits_on_its_kernel(pid), 20, "the worker to block")


def test_a_blocked_worker_stops_the_reaping_of_other_tenants_sessions(broker: BrokerProcess) -> None:
    bob = connect(broker.target, token=broker.tokens["bob"])
    bob.allocate_memory(1 << 20)
    mallory = connect(broker.target, token=broker.tokens["mallory"])
    worker = 0
    try:
        [worker] = worker_pids(broker, "mallory")
        _block(mallory, worker)
        mallory._closed.set()  # her client stops heartbeating: her session expires
        with AdminClient(broker.target, broker.tokens["ops"]) as admin:
            # The reaper takes her session off the list, then waits on her worker to close it.
            wait_for(lambda: not admin.list_sessions("mallory"), 10 * LEASE, "mallory's session to expire")
            bob._closed.set()  # bob's client dies: his session should be reaped one lease later
            dead_at = time.monotonic()
            refused: list[str] = []
            while time.monotonic() - dead_at < GRACE:
                try:
                    with connect(broker.target, token=broker.tokens["bob"]):
                        break
                except ResourceExhausted as exc:
                    refused.append(exc.message)
                time.sleep(0.5)
            reopened = time.monotonic() - dead_at < GRACE
            listed = [s.session for s in admin.list_sessions("bob")]
            mallory_listed = [s.session for s in admin.list_sessions("mallory")]
        assert reopened, (
            f"bob's dead session (lease {LEASE:g} s) was not reaped within {GRACE:g} s while mallory's worker "
            f"blocked in a lone synchronize: bob's sessions still listed {listed}, mallory's {mallory_listed}; "
            f"bob's new session refused {len(refused)} times ({refused[-1] if refused else ''})")
    finally:
        if worker:  # (the next test blocks a worker of its own; the expiry has usually stopped this one already:
            # an expired session's work still running after a second is stopped with its worker)
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)
        for gpu in (mallory, bob):
            try:
                gpu.close()
            except GpuBrokerError:
                pass


def test_the_broker_stops_within_its_grace_while_a_worker_blocks(broker: BrokerProcess) -> None:
    """The same pattern in the broker's stop: it ended each session left by awaiting its worker's close, in turn,
    with no timeout. A second SIGTERM cuts the drain short and stops the broker at once, but a broker whose tenant's
    worker blocked in a lone synchronize never stopped (only a SIGKILL did, and no worker got its grace)."""
    erin = connect(broker.target, token=broker.tokens["erin"])
    [worker] = worker_pids(broker, "erin")
    _block(erin, worker)
    assert broker.process is not None
    broker.process.send_signal(signal.SIGTERM)
    wait_for(lambda: "draining: new sessions are refused" in broker.log_tail(200_000), 20, "the drain to begin")
    started = time.monotonic()
    broker.process.send_signal(signal.SIGTERM)  # the operator will not wait for the drain
    try:
        code: int | None = broker.process.wait(STOP_BOUND)
    except subprocess.TimeoutExpired:
        code = None
    took = time.monotonic() - started
    log = broker.log_tail(1500)
    if code is None:
        broker.stop(timeout=0)  # (SIGKILL: erin's close below then fails at once)
    try:
        erin.close()
    except GpuBrokerError:
        pass
    assert code == 0, (f"a second SIGTERM did not stop the broker within {STOP_BOUND:g} s while erin's worker "
                       f"blocked in a lone synchronize (exit status {code}); log: {log}")
    assert took < STOP_BOUND
    # Its worker went with it (killed past the stop's grace, or by its parent-death signal).
    wait_for(lambda: not Path(f"/proc/{worker}").exists(), 10, "erin's worker to end")
