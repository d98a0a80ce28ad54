"""A client that starts a copy and waits to be killed in the middle of it (run by test_chaos and test_timeouts).

``python killable_client.py TARGET TOKEN MODE``: MODE "h2d" or "d2h" holds a streamed gRPC copy open, "shm" loops
over shared-memory copies, "stall" opens an upload and stops its own process (alive, connected and silent),
"spin" launches a kernel that runs for days and waits for it in a plain `synchronize()` (no `with` block: a
script's Ctrl-C lands in the wait). It prints "copying" (for "stall", its session; for "spin", "waiting" and its
session) once the copy or the kernel is under way.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator

import numpy as np

from gpubroker.broker import samples
from gpubroker.client import connect
from gpubroker.client._channel import make_channel
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

MIB = 1 << 20


def main(target: str, token: str, mode: str) -> None:
    gpu = connect(target, token=token, shared_memory=mode == "shm")
    if mode == "spin":
        spin = gpu.compile_kernel(samples.source(gpu.device_info().backend), "spin")
        gpu.execute_kernel(spin, 1, 1, [gpu.allocate_memory(4096), np.int64(1 << 50)])
        print("waiting", gpu.session, flush=True)
        gpu.synchronize()
        return
    buf = gpu.allocate_memory(32 * MIB)
    if mode == "shm":  # copies between device memory and a host array the worker has mapped (and pinned on CUDA)
        host = gpu.host_array(32 * MIB, np.uint8)
        gpu.copy_h2d(host, buf)
        print("copying", flush=True)
        while True:
            gpu.copy_h2d(host, buf)
            gpu.copy_d2h(buf, host)
    stub = pb_grpc.GpuBrokerStub(make_channel(target, token)[0])
    ref = pb.BufferRef(handle=buf.handle)
    if mode == "d2h":
        reads = stub.CopyDeviceToHost(pb.CopyDeviceToHostRequest(session=gpu.session, buffer=ref, size=32 * MIB),
                                      timeout=600)
        next(reads)
        print("copying", flush=True)
        threading.Event().wait()

    def chunks() -> Iterator[pb.HostToDeviceChunk]:
        header = pb.HostToDeviceHeader(session=gpu.session, buffer=ref, size=32 * MIB)
        yield pb.HostToDeviceChunk(header=header, data=bytes(MIB))
        print(gpu.session if mode == "stall" else "copying", flush=True)
        if mode == "stall":  # alive, connected, and silent: it answers nothing, not even the broker's pings
            os.kill(os.getpid(), signal.SIGSTOP)
        threading.Event().wait()

    stub.CopyHostToDevice(chunks(), timeout=600)


if __name__ == "__main__":
    main(*sys.argv[1:4])
