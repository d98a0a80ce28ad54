"""Handles belong to their session; a crashed worker or a vanished client harms nobody else."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.broker.launcher import BrokerProcess
from gpubroker.client import Aborted, Buffer, NotFound, WorkerCrashed, connect

from ..conftest import worker_pids
from ..helpers import wait_for


def test_handles_are_scoped_to_their_session(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["alice"]) as a, \
            connect(broker.target, token=broker.tokens["bob"]) as b, \
            connect(broker.target, token=broker.tokens["alice"]) as a2:
        secret = np.arange(64, dtype=np.uint8)
        buf = a.allocate_memory(64)
        a.copy_h2d(secret, buf)
        stream = a.create_stream()
        kernel = a.compile_kernel(samples.source(a.device_info().backend), "scale_inplace")
        for other in (b, a2):  # another tenant, and another session of the same tenant
            with pytest.raises(NotFound):
                other.copy_d2h(buf, bytearray(64))
            with pytest.raises(NotFound):
                other.copy_h2d(b"\0" * 64, buf)
            with pytest.raises(NotFound):
                other.free_memory(buf)
            with pytest.raises(NotFound):
                other.execute_kernel(kernel, 1, 16, [buf, np.float32(2), np.int32(16)])
            with pytest.raises(NotFound):
                other.synchronize(stream)
        out = bytearray(64)
        a.copy_d2h(buf, out)
        assert bytes(out) == secret.tobytes()
    # The session is closed: its handles are gone with it.
    with connect(broker.target, token=broker.tokens["alice"]) as again, pytest.raises(NotFound):
        again.free_memory(Buffer(buf.handle, 64))


def test_handles_are_unguessable(broker: BrokerProcess) -> None:
    # The client names its handles (scoped to its session, so another session's are NOT_FOUND anyway): 64 random
    # bits each, so neither can one be guessed nor two collide.
    with connect(broker.target, token=broker.tokens["alice"]) as a:
        handles = {a.allocate_memory(8).handle for _ in range(20)}
    assert len(handles) == 20
    assert all(len(h) == 17 and int(h[1:], 16) >= 0 for h in handles)


def test_sigkill_of_one_workers_fails_only_that_tenant(fresh_broker: BrokerProcess) -> None:
    with connect(fresh_broker.target, token=fresh_broker.tokens["bob"]) as bob, \
            connect(fresh_broker.target, token=fresh_broker.tokens["alice"]) as alice:
        backend = bob.device_info().backend
        data = np.arange(1000, dtype=np.float32)
        bob_buf = bob.allocate_memory(data.nbytes)
        bob.copy_h2d(data, bob_buf)
        alice_buf = alice.allocate_memory(4096)
        (pid,) = worker_pids(fresh_broker, "alice")
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerCrashed) as info:
            alice.copy_h2d(b"x" * 16, alice_buf)
        assert "SIGKILL" in info.value.message and "alice" in info.value.message
        # bob is untouched: his data is intact and he can still compute.
        kernel = bob.compile_kernel(samples.source(backend), "scale_inplace")
        bob.execute_kernel(kernel, 4, 256, [bob_buf, np.float32(2), np.int32(1000)])
        bob.synchronize()
        out = np.empty_like(data)
        bob.copy_d2h(bob_buf, out)
        np.testing.assert_array_equal(out, data * 2 + 1)
    # alice's next session gets a fresh worker and works.
    with connect(fresh_broker.target, token=fresh_broker.tokens["alice"]) as alice2:
        buf = alice2.allocate_memory(16)
        alice2.copy_h2d(b"y" * 16, buf)
        out2 = bytearray(16)
        alice2.copy_d2h(buf, out2)
        assert out2 == b"y" * 16
        assert alice2.device_info().memory_used == 16  # the dead session's 4 KiB went back to the quota
        assert worker_pids(fresh_broker, "alice") != [pid]


def test_faulting_kernel_ends_only_its_tenant(fresh_broker: BrokerProcess) -> None:
    """A kernel writing far out of bounds may crash its worker; the broker and other tenants live on."""
    with connect(fresh_broker.target, token=fresh_broker.tokens["bob"]) as bob, \
            connect(fresh_broker.target, token=fresh_broker.tokens["carol"]) as carol:
        backend = bob.device_info().backend
        bob_buf = bob.allocate_memory(64)
        bob.copy_h2d(b"b" * 64, bob_buf)
        kernel = carol.compile_kernel(samples.source(backend), "write_far")
        small = carol.allocate_memory(16)
        # PoCL's worker dies of SIGSEGV; CUDA reports an illegal address and the worker exits (context lost).
        with pytest.raises(Aborted) as info:
            carol.execute_kernel(kernel, 1, 1, [small, np.int64(1 << 40)])
            carol.synchronize()
        assert "carol" in info.value.message or "illegal" in info.value.message.lower()
        with pytest.raises(WorkerCrashed):
            carol.allocate_memory(8)
        out = bytearray(64)
        bob.copy_d2h(bob_buf, out)
        assert out == b"b" * 64
    with connect(fresh_broker.target, token=fresh_broker.tokens["carol"]) as carol2:
        buf = carol2.allocate_memory(8)
        carol2.copy_h2d(b"c" * 8, buf)


CLIENT = textwrap.dedent("""
    import sys
    from gpubroker.client import connect
    gpu = connect(sys.argv[1], token=sys.argv[2])
    for _ in range(4):
        gpu.allocate_memory(1 << 20)
    print("allocated", flush=True)
    sys.stdin.read()  # block until killed
""")


def test_killed_client_has_its_memory_freed_when_the_lease_ends(fresh_broker: BrokerProcess) -> None:
    with connect(fresh_broker.target, token=fresh_broker.tokens["alice"]) as observer:
        assert observer.device_info().memory_used == 0
        child = subprocess.Popen([sys.executable, "-c", CLIENT, fresh_broker.target, fresh_broker.tokens["alice"]],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert child.stdout is not None
        assert child.stdout.readline().strip() == b"allocated"
        assert observer.device_info().memory_used == 4 << 20
        child.kill()
        child.wait()
        wait_for(lambda: observer.device_info().memory_used == 0, timeout=15, what="the lease to expire")
