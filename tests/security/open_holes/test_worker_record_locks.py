"""Open hole (issue 21, round 9): POSIX record locks hold host kernel memory that no limit of the worker counts.

``fcntl(F_SETLK)`` with F_RDLCK on disjoint one-byte ranges of files in the worker's own /tmp: one ``file_lock_cache``
object (192 bytes) per range, unbounded per descriptor (Linux does not enforce RLIMIT_LOCKS); 512,000 locks held
96 MiB, taken in about 3 s. Only a memory cgroup counts them. Refusing record locks once the device is open (as
Landlock and seccomp are, test_worker_kernel_objects.py) breaks the OpenCL worker: pyopencl's caches are sqlite
databases (pytools' PersistentDict), and sqlite locks each transaction ("OperationalError: access permission
denied" at the next compile).
"""

from __future__ import annotations

import numpy as np

from gpubroker.broker.launcher import BrokerProcess
from gpubroker.client import ModuleFormat, connect

from ..test_worker_kernel_objects import ALLOWED, LOCK_FILES, LOCKS_PER_FILE, SOURCE, broker, unreclaimable_slab

__all__ = ["broker"]  # (the fixture, imported: one broker of this module's own)


def test_posix_record_locks_are_bounded(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"], timeout=120) as gpu:
        module = gpu.load_module(SOURCE, ModuleFormat.OPENCL_C)
        attack, close = gpu.get_kernel(module, "gpb_locks"), gpu.get_kernel(module, "gpb_close")
        scratch, res = gpu.allocate_memory(4096), gpu.allocate_memory(8 * (8 + LOCK_FILES))
        before = unreclaimable_slab()
        gpu.execute_kernel(attack, 1, 1, [scratch, np.int64(LOCK_FILES), np.int64(LOCKS_PER_FILE), res])
        gpu.synchronize()
        held = unreclaimable_slab() - before
        out = np.empty(8, dtype=np.int64)
        gpu.copy_d2h(res, out)
        files, locks, err = (int(v) for v in out[:3])
        if files:
            gpu.execute_kernel(close, 1, 1, [res, np.int64(files)])
            gpu.synchronize()
    print(f"\nthe worker took {locks} record locks on {files} files (last error {err}); the host's unreclaimable "
          f"slab grew by {held >> 20} MiB meanwhile")
    assert held < ALLOWED, (f"a tenant's kernel held {held >> 20} MiB of host kernel memory in {locks} POSIX record "
                            "locks that no limit of its worker counts")
