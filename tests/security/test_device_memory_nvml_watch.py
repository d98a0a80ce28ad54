"""On CUDA, device memory a tenant's worker takes outside its quota is bounded from outside the worker, by NVML.

The quota is counted inside the worker (worker/_handles.py), and memory can be taken past that count without any
exploit: a module's ``__device__`` arrays are allocated by the driver as the module loads, and no quota sees them
(with native code in the worker, as on PoCL, any allocation). Before the fix nothing but the GPU bounded it: one
tenant could take the whole device's memory and fail every other tenant's allocations. Now the front reads every
worker's device memory from NVML every 0.1 s (front/_memwatch.py) and kills a worker holding more than its
tenant's quota plus ``device_memory_headroom`` (1 GiB by default: the CUDA context, ~525 MiB, and what libraries
take): the tenant's calls fail with RESOURCE_EXHAUSTED naming the headroom, the kill is its crash and a
``gpubroker_device_memory_kills{cause="nvml"}``, and another tenant, holding 3 GiB within its own quota, works on.

Needs nvidia-ml-py (pynvml) where the broker runs: ``./dev gpu-wheels`` carries it.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import ResourceExhausted, connect

from ..conftest import worker_pids
from ..helpers import wait_for
from ._probes import metric

pytestmark = pytest.mark.cuda

ALICE_QUOTA = 64 << 20
BOB_QUOTA = 4 << 30
BOB_HOLDS = 3 << 30  # within his quota: his worker holds this plus its context, under his quota plus the headroom
HOARD = 1536 << 20  # a module's global array: 1.5 GiB no quota counts
FILL = r"""
extern "C" __global__ void fill(int* x, int n, int v) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}
"""
HOARDER = f"__device__ char hoard[{HOARD}];" + r"""
extern "C" __global__ void touch(long n) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) hoard[i] = 1;
}
"""


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    tenants = [TenantSpec("alice", memory_quota=ALICE_QUOTA), TenantSpec("bob", memory_quota=BOB_QUOTA)]
    with BrokerProcess(tenants, backend="cuda", settings={"metrics_listen": "127.0.0.1:0"}) as proc:
        yield proc




def _nvml_held(pid: int) -> int | None:
    """What NVML says the process holds on any GPU (None: not listed), read here to report the figures."""
    import pynvml

    pynvml.nvmlInit()
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid == pid and process.usedGpuMemory is not None:
                    return int(process.usedGpuMemory)
    finally:
        pynvml.nvmlShutdown()
    return None


def test_a_module_hoarding_device_memory_past_the_quota_gets_its_worker_killed(broker: BrokerProcess) -> None:
    assert "NVML is read every" in broker.log_tail(1 << 20), "the broker does not watch device memory"
    bob = connect(broker.target, token=broker.tokens["bob"])
    bob_fill = bob.compile_kernel(FILL, "fill")
    bob_buf = bob.allocate_memory(BOB_HOLDS)
    alice = connect(broker.target, token=broker.tokens["alice"])
    alice_buf = alice.allocate_memory(ALICE_QUOTA)  # her whole quota: with her context, within quota + headroom
    (alice_pid,) = worker_pids(broker, "alice")
    (bob_pid,) = worker_pids(broker, "bob")
    wait_for(lambda: (_nvml_held(alice_pid) or 0) >= ALICE_QUOTA, 10, "NVML to list alice's worker")
    # At her quota she works on (the watch has read her worker's figures by now: it reads every 0.1 s).
    fill = alice.compile_kernel(FILL, "fill")
    n = ALICE_QUOTA // 4
    for v in range(20):
        alice.execute_kernel(fill, (n + 255) // 256, 256, [alice_buf, np.int32(n), np.int32(v)])
        alice.synchronize()
    print(f"NVML: alice's worker holds {_nvml_held(alice_pid) or 0:,} bytes with {ALICE_QUOTA:,} allocated; bob's "
          f"{_nvml_held(bob_pid) or 0:,} with {BOB_HOLDS:,}")
    assert metric(broker, "gpubroker_device_memory_kills_total", tenant="alice", cause="nvml") == 0

    # The hoard: 1.5 GiB as the module loads (touched, so it is there whatever the driver defers).
    def killed() -> bool:
        try:
            touch = alice.compile_kernel(HOARDER, "touch")  # (the watch may kill the worker as the module loads)
            alice.execute_kernel(touch, 528, 256, [np.int64(HOARD)])
            alice.synchronize()
        except ResourceExhausted as exc:
            assert "device_memory_headroom" in exc.message and "NVML" in exc.message, exc.message
            return True
        return False

    wait_for(killed, 10, "alice's worker killed for holding device memory past her quota plus the headroom")
    wait_for(lambda: metric(broker, "gpubroker_device_memory_kills_total", tenant="alice", cause="nvml") == 1, 10,
             "the kill counted")
    assert metric(broker, "gpubroker_tenant_worker_crashes_total", tenant="alice") == 1
    assert metric(broker, "gpubroker_tenant_worker_crashes_total", tenant="bob") == 0
    assert "action=kill-worker reason=device-memory tenant=alice" in broker.log_tail(1 << 20)

    # Bob, holding 3 GiB within his own quota, worked on throughout.
    m = 1 << 20
    bob.execute_kernel(bob_fill, m // 256, 256, [bob_buf, np.int32(m), np.int32(7)])
    out = np.empty(m, np.int32)
    bob.copy_d2h(bob_buf, out)
    assert (out == 7).all()
    assert metric(broker, "gpubroker_device_memory_kills_total", tenant="bob", cause="nvml") == 0
    # Alice's next session gets a fresh worker.
    again = connect(broker.target, token=broker.tokens["alice"])
    again.allocate_memory(ALICE_QUOTA)
    with pytest.raises(ResourceExhausted, match="memory quota exceeded"):
        again.allocate_memory(1)
