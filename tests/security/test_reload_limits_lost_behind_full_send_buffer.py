"""A reload's lower quota reaches a tenant whose worker's send buffer is full (issue 21, round 7): it did not, and
the tenant kept its old quota.

The hole was: a reload sends every live worker its limits (``WorkerPool.apply_limits`` -> ``_set_limits`` ->
``WorkerClient.call(SetLimits)``, front/workers/_pool.py) in a task of its own. That call goes through
``WorkerClient._send``, which refuses any request (RESOURCE_EXHAUSTED) once the bytes the front holds toward the
worker pass ``worker_send_buffer_bytes``, the cap meant for the *tenant's* requests. ``_set_limits`` catches the
error, logs one INFO line ("set_limits for tenant ... would pass the ...-byte limit") and drops it: nothing sends
the limits again. The quota (``memory_quota``), ``max_handles`` and ``max_streams`` are enforced only by the worker
(worker/_handles.py), so the worker keeps the old ones until it is restarted; the front's own view (device_info's
``memory_quota``) shows the new one.

The tenant fills that buffer on purpose: it parks its worker in a kernel that sleeps (alone on the device, no time
limit applies: ``lone_kernel_seconds`` = 0), and sends module loads (``LoadModule`` is not device work: it goes
straight to the worker's channel) of decreasing sizes until even a tiny one is refused. From then on every request
of the front's to that worker is refused too, the reload's ``SetLimits`` included, for as long as the tenant likes
(``worker_write_stall_seconds``, 300 s by default, is the only bound, and the tenant can let its worker read a
little and fill again). The operator who lowered the tenant's quota (or its handles or streams) sees the reload
succeed and the new quota in ``device_info``; the worker enforces the old one.

Measured (2-core VM, PoCL; worker_send_buffer_bytes = 1 MiB here to keep the fill short, the same with the default
64 MiB and 32 more loads): mallory's quota lowered from 256 MiB to 32 MiB by a reload while her buffer was full;
the log said "set_limits for tenant mallory on device 0: the worker ... has 1048... bytes of requests waiting ...",
and once her kernel ended she allocated 128 MiB (4x the new quota) without a refusal, while device_info reported a
quota of 32 MiB.

The fix: the front's own requests to a worker (limits, closing, accounting: ``tenant_code = False``) are never
refused for the tenant's backlog (they are few and small, each waiting for its reply); only the tenant's own are
capped by worker_send_buffer_bytes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from gpubroker.broker.config import load_config, save_config
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import GpuBrokerError, ModuleFormat, RemoteGpu, connect

from ..conftest import worker_pids
from ..helpers import wait_for
from ._probes import kernel_sleeps
from .exploits import SYSCALL_SOURCE, check_arch

SLEEP_SOURCE = SYSCALL_SOURCE + r"""
__kernel void gpb_sleep(__global long* out, const long tenths) {
    long ts[2] = {0, 100000000};
    for (long i = 0; i < tenths; ++i) out[0] = sys6(35, (long)ts, 0, 0, 0, 0, 0);   /* nanosleep(0.1 s) */
}
"""
MiB = 1 << 20
OLD_QUOTA, NEW_QUOTA = 256 * MiB, 32 * MiB
SEND_BUFFER = 1 * MiB
# 10 s: the fill and the reload take ~4 s on a 2-core VM (checked below); the test waits for its end
SLEEP_TENTHS = 100
SESSIONS = 6


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    check_arch()
    settings: dict[str, object] = {"lease_seconds": 120.0, "worker_send_buffer_bytes": SEND_BUFFER}
    with BrokerProcess([TenantSpec("mallory", memory_quota=OLD_QUOTA)], backend="opencl",
                       settings=settings) as proc:
        yield proc


class _Load(threading.Thread):
    """One LoadModule of ``size`` bytes in its own thread: refused at once, or held until the worker reads it."""

    def __init__(self, gpu: RemoteGpu, size: int) -> None:
        super().__init__(daemon=True)
        self.gpu, self.size = gpu, size
        self.error: str | None = None

    def run(self) -> None:
        try:
            self.gpu.load_module("/*" + "x" * max(0, self.size - 4) + "*/", ModuleFormat.OPENCL_C)
        except GpuBrokerError as exc:
            self.error = f"{type(exc).__name__}: {exc}"


def test_a_reload_lowering_the_quota_reaches_a_worker_whose_send_buffer_is_full(broker: BrokerProcess) -> None:
    token = broker.tokens["mallory"]
    gpus = [connect(broker.target, token=token, transport="grpc", shared_memory=False, timeout=120)
            for _ in range(SESSIONS)]
    loads: list[_Load] = []
    try:
        for gpu in gpus:
            gpu.initialize()
        main = gpus[0]
        kernel = main.compile_kernel(SLEEP_SOURCE, "gpb_sleep")
        out = main.allocate_memory(64)
        [worker] = worker_pids(broker, "mallory")
        main.execute_kernel(kernel, 1, 1, [out, np.int64(SLEEP_TENTHS)])
        blocker = threading.Thread(target=lambda: main.synchronize(), daemon=True)
        blocker.start()
        kernel_started = time.monotonic()
        wait_for(lambda: kernel_sleeps(worker), 20, "mallory's worker to sleep in its kernel")

        # Fill the front's buffer toward her worker: loads of halving sizes, each until one is refused.
        refused = 0
        size = SEND_BUFFER // 2
        turn = 0
        while size >= 128:
            load = _Load(gpus[1 + turn % (SESSIONS - 1)], size)
            turn += 1
            load.start()
            load.join(0.4)
            if load.is_alive():
                loads.append(load)  # queued toward the worker
                continue
            if load.error is not None and "worker_send_buffer_bytes" in load.error:
                refused += 1
                size //= 2
                continue
            pytest.fail(f"a {size}-byte load ended while the worker slept: {load.error}")
        assert refused, "no load was refused: the buffer never filled"

        cfg = load_config(broker.config_path)
        tenants = dict(cfg.tenants)
        tenants["mallory"] = msgspec.structs.replace(tenants["mallory"], memory_quota=NEW_QUOTA)
        save_config(msgspec.structs.replace(cfg, tenants=tenants), broker.config_path)
        assert broker.process is not None
        os.kill(broker.process.pid, signal.SIGHUP)
        wait_for(lambda: "action=reload" in broker.log_tail(1_000_000), 20, "the reload to finish")
        lost = [line for line in broker.log_tail(1_000_000).splitlines() if "set_limits for tenant mallory" in line]
        # (polled: one look can find the kernel's thread between two of its 0.1 s naps, waiting for a busy CPU)
        assert time.monotonic() - kernel_started < SLEEP_TENTHS / 10, (
            "the kernel ended before the reload: make SLEEP_TENTHS longer")
        wait_for(lambda: kernel_sleeps(worker), 2, "the kernel still sleeping after the reload")

        # Her kernel ends by itself; the worker then reads what waited.
        blocker.join(SLEEP_TENTHS / 10 + 30)
        for load in loads:
            load.join(60)
        reported = main.device_info().memory_quota
        try:
            big = main.allocate_memory(4 * NEW_QUOTA)
            main.memset(big, 1)  # (really used)
            main.synchronize()
            allocated: str = "allowed"
        except GpuBrokerError as exc:
            allocated = f"refused ({type(exc).__name__}: {exc})"
        print(f"\n{len(loads)} loads queued, {refused} refused; the reload's limits: {lost[:1]}; device_info's "
              f"quota {reported}; a {4 * NEW_QUOTA} byte allocation after the reload: {allocated}")
        assert allocated != "allowed", (
            f"the reload lowered mallory's quota to {NEW_QUOTA} bytes (device_info says {reported}), but her worker "
            f"never got it: its send buffer was full, the reload's SetLimits was refused ({lost[:1]}) and dropped; "
            f"she allocated {4 * NEW_QUOTA} bytes")
    finally:
        for gpu in gpus:
            try:
                gpu.close()
            except GpuBrokerError:
                pass
