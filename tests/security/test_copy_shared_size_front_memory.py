"""One CopyShared call with a huge size must not make the front build its pieces in memory: it killed the broker.

The hole (issue 21, a fresh attack on the typed RPCs): the front splits a ``CopyShared`` into pieces of 256 MiB,
each its own batch and scheduler turn, and built the whole list of them before running the first. The size is
the client's int64: a tenant's one call with ``size = 2**62`` (any segment name, no segment needed) made the front
build 2**34 commands on its event loop, which served nobody meanwhile, and grow until the kernel's OOM killer
killed it: measured on a 24 GiB host, the front at 24 GB RSS and SIGKILLed within seconds, every tenant's sessions
gone with it.

Now the pieces are made one at a time as each runs, and the first that the worker refuses (the copy runs past the
segment, or there is no such segment) ends the call: the front's memory does not move, and another tenant's calls
go on. Here a watchdog kills the broker if its front grows by more than ``GROWTH_LIMIT``, so that the test fails
rather than the host running out of memory.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

from ._probes import tenant_credentials

GROWTH_LIMIT = 512 << 20  # the front's RSS may not grow by more during the call (it grew by GBs a second before)
CALL_SECONDS = 20.0


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with BrokerProcess([TenantSpec("mallory"), TenantSpec("alice")], backend="opencl") as proc:
        yield proc


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@pytest.mark.parametrize("size", [2**62, 2**63 - 1])
def test_a_huge_copy_shared_is_refused_without_growing_the_front(broker: BrokerProcess, size: int) -> None:
    assert broker.process is not None and broker.process.poll() is None
    front = broker.process.pid
    with grpc.secure_channel(broker.target, tenant_credentials(broker, "mallory")) as channel, \
            grpc.secure_channel(broker.target, tenant_credentials(broker, "alice")) as other:
        stub, alice = pb_grpc.GpuBrokerStub(channel), pb_grpc.GpuBrokerStub(other)
        session = stub.OpenSession(pb.OpenSessionRequest(), timeout=60).session
        buf = stub.Allocate(pb.AllocateRequest(session=session, size=4096), timeout=30).handle
        theirs = alice.OpenSession(pb.OpenSessionRequest(), timeout=60).session
        base = peak = _rss(front)
        outcome: list[str] = []

        def call() -> None:
            try:
                stub.CopyShared(pb.CopySharedRequest(session=session, segment="g_none", buffer=pb.BufferRef(handle=buf),
                                                     size=size, to_device=True), timeout=CALL_SECONDS)
                outcome.append("OK")
            except grpc.RpcError as exc:
                outcome.append(exc.code().name)

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        deadline = time.monotonic() + CALL_SECONDS + 5
        killed = False
        while caller.is_alive() and time.monotonic() < deadline:
            peak = max(peak, _rss(front))
            if peak - base > GROWTH_LIMIT:  # (the watchdog: the host must not run out of memory)
                os.killpg(front, signal.SIGKILL)
                killed = True
                break
            time.sleep(0.02)
        caller.join(CALL_SECONDS)
        grown = (peak - base) / 2**20
        print(f"\nCopyShared of {size} bytes: {outcome}, the front grew by {grown:.0f} MiB")
        assert not killed, (f"one CopyShared of {size} bytes grew the front by more than "
                            f"{GROWTH_LIMIT >> 20} MiB ({grown:.0f} MiB): killed before it took the host's memory")
        assert outcome and outcome[0] in ("NOT_FOUND", "OUT_OF_RANGE", "INVALID_ARGUMENT"), outcome
        # The front serves on: another tenant's call, and the caller's own session.
        alice.Heartbeat(pb.SessionRequest(session=theirs), timeout=10)
        stub.Heartbeat(pb.SessionRequest(session=session), timeout=10)
