"""One tenant's blocked worker stalls every reload: other tenants' removals never complete, and a removed tenant's
worker runs on.

The hole: ``Broker.reload`` (front/_server.py), after revoking tokens, sends every live worker its limits again
(``WorkerPool.apply_limits``: ``await worker.call(SetLimits)``, one worker after the other, with no timeout), and
only then ends the removed tenants' sessions and stops their workers (``SessionManager.end_tenant``, whose
``close`` awaits ``CloseSession`` from the worker, again with no timeout). A worker answers the front only between
the commands it runs, and a tenant can keep its worker inside one for as long as it likes: a kernel that sleeps
(``nanosleep``: no CPU), then a ``synchronize``. Nobody else uses the device, so no time limit applies
(``lone_kernel_seconds``: 600 s by default). The reload then waits on that
worker for as long as the kernel lasts; so does every later reload (each SIGHUP or admin Reload is a new task that
stops at the same worker). Meanwhile the tenants the operator removed keep their sessions, their workers (and the
device memory and processes they hold) and their caches; quota changes are not applied. A removal of the blocking
tenant itself never completes either: its worker, and the kernel it runs, outlive its removal.

The attack: mallory launches a kernel that sleeps for minutes and synchronizes. carol has a session open. The
operator removes carol (``gpubroker tenant remove`` + SIGHUP), then mallory.

Measured (2-core VM, PoCL, defaults): the reload's revocation happened at once ("action=revoke tenant=carol"), but
15 s later carol's worker and session were still there and the reload had not finished (no "action=reload" line);
after mallory's removal too, mallory's worker was still alive 15 s later, its kernel still running. The broker stays
that way as long as mallory's kernel sleeps.

Suggested fix: never await a tenant's worker inside an operation that serves others. Send SetLimits to all workers
at once and do not wait for the replies in the reload (a worker applies them when it next reads); end a removed
tenant's sessions without asking its workers (kill them: ``stop_tenant`` first, then forget the sessions), or bound
every such call (``asyncio.wait_for``, then kill the worker, charged to its tenant). The same pattern is in the
lease reaper (``_reap_loop`` awaits ``close`` of each expired session in turn): one blocked worker there stops the
reaping of every tenant's expired sessions.

The fix (front/_server.py, _sessions.py, workers/_pool.py): the reload sends the limits to every worker at once, each
in a task of its own, and waits at most a second for those that answer; a removed tenant's workers are killed
(``WorkerPool.retire_tenant``) and its sessions dropped without a request to them. The test checks that the reload
removing carol finishes while mallory's worker still blocks, and that mallory's removal ends her worker.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker.config import BrokerConfig, load_config, save_config
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import GpuBrokerError, connect

from ..conftest import worker_pids
from ..helpers import wait_for
from ._probes import kernel_sleeps, waits_on_its_kernel
from .exploits import SYSCALL_SOURCE, check_arch

SLEEP_SOURCE = SYSCALL_SOURCE + r"""
__kernel void gpb_sleep(__global long* out, const long seconds) {
    long ts[2] = {1, 0};
    for (long i = 0; i < seconds; ++i) out[0] = sys6(35, (long)ts, 0, 0, 0, 0, 0);   /* nanosleep(1 s) */
}
"""
SLEEP = 150  # seconds: longer than the test; her removal ends it
GRACE = 10.0  # how long the test gives a removal to complete (normally well under a second)


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    check_arch()
    tenants = [TenantSpec("ops", admin=True), TenantSpec("mallory"), TenantSpec("carol")]
    with BrokerProcess(tenants, backend="opencl", settings={"lease_seconds": 120.0}) as proc:
        yield proc


def _reload(broker: BrokerProcess, cfg: BrokerConfig, tenant: str) -> None:
    save_config(cfg, broker.config_path)
    assert broker.process is not None
    os.kill(broker.process.pid, signal.SIGHUP)
    wait_for(lambda: f"action=revoke tenant={tenant}" in broker.log_tail(1_000_000), 20,
             f"{tenant}'s token to be revoked by the reload")


def test_a_blocked_worker_stalls_other_tenants_removal_and_its_own(broker: BrokerProcess) -> None:
    carol = connect(broker.target, token=broker.tokens["carol"])
    carol.allocate_memory(1 << 20)
    [carol_worker] = worker_pids(broker, "carol")
    mallory = connect(broker.target, token=broker.tokens["mallory"])
    worker = 0
    try:
        kernel = mallory.compile_kernel(SLEEP_SOURCE, "gpb_sleep")
        out = mallory.allocate_memory(64)
        [worker] = worker_pids(broker, "mallory")
        mallory.execute_kernel(kernel, 1, 1, [out, np.int64(SLEEP)])

        def block() -> None:
            try:
                mallory.synchronize()
            except GpuBrokerError:
                pass  # (her link is closed at her removal)

        threading.Thread(target=block, daemon=True).start()
        wait_for(lambda: waits_on_its_kernel(worker), 20, "mallory's worker to block")

        cfg = load_config(broker.config_path)
        cfg.remove_tenant("carol")
        _reload(broker, cfg, "carol")
        removed_at = time.monotonic()
        while time.monotonic() - removed_at < GRACE and not (
                "removed=['carol']" in broker.log_tail(1_000_000) and carol_worker not in worker_pids(broker, "carol")):
            time.sleep(0.2)
        carol_alive = carol_worker in worker_pids(broker, "carol")
        carol_reloaded = "action=reload added=[] removed=['carol']" in broker.log_tail(1_000_000)
        still_blocked = waits_on_its_kernel(worker)  # (what the reload had to get past)

        cfg = load_config(broker.config_path)
        cfg.remove_tenant("mallory")
        _reload(broker, cfg, "mallory")
        removed_at = time.monotonic()
        while time.monotonic() - removed_at < GRACE and worker in worker_pids(broker, "mallory"):
            time.sleep(0.2)
        mallory_alive = worker in worker_pids(broker, "mallory")
        sleeping = kernel_sleeps(worker)
        mallory_reloaded = "removed=['mallory']" in broker.log_tail(1_000_000)

        assert still_blocked, "mallory's worker stopped blocking before the reload: make SLEEP longer"
        assert carol_reloaded and not carol_alive and not mallory_alive and mallory_reloaded, (
            f"{GRACE:g} s after their removal, while mallory's worker blocked in a lone synchronize: the reload "
            f"removing carol finished: {carol_reloaded}, carol's worker alive: {carol_alive}; mallory's removal "
            f"finished: {mallory_reloaded}, her worker alive: {mallory_alive}, its kernel still sleeping: "
            f"{sleeping}; log: {broker.log_tail(1500)}")
    finally:
        if worker and Path(f"/proc/{worker}").exists():  # (unfixed, the broker's stop would wait for her kernel)
            os.kill(worker, signal.SIGKILL)
        for gpu in (mallory, carol):
            try:
                gpu.close()
            except GpuBrokerError:
                pass
