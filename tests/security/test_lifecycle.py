"""Lifecycle: what a tenant leaves behind at its removal, and the races between a credential's use and its end.

Each test is the attack, through a real broker on PoCL:

- a tenant poisons its own compile cache (a kernel renames a look-alike's compiled code over one of its cached
  kernels), is removed, and a new tenant is added under its name with a new token: the new tenant's kernel must
  compute what its source says (its cache is not its predecessor's, which is deleted with the removal);
- a link hello with a token reaches the front while the tenant's worker sits in a long kernel; the token is
  rotated and the broker reloaded before the worker takes the link: the link must never be served;
- 16 OpenSession calls at once from a tenant with no running worker, against a cap of 5: exactly 5 sessions.
"""

from __future__ import annotations

import contextlib
import fcntl
import secrets
import socket
import struct
import subprocess
import sys
import termios
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from gpubroker.broker.config import rotate_token_in_place
from gpubroker.broker.front.auth import mint_token
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import (
    AdminClient,
    GpuBrokerError,
    Kernel,
    ModuleFormat,
    RemoteGpu,
    Unauthenticated,
    connect,
    list_devices,
)
from gpubroker.client._channel import make_channel
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc
from gpubroker.wire.commands import Batch, Read, decode_ack, encode
from gpubroker.wire.frames import pack_frame, recv_frame

from ..helpers import recv_payload, send_payload, wait_for
from .exploits import (
    ATTACK_SOURCE,
    Program,
    buffer_address,
    check_arch,
    find_worker,
    kernel_source,
    pid_state,
    run,
)

TIMEOUT = 60.0  # every client call is bounded: a stuck front must fail a test, never hang it
MAX_SESSIONS = 5
# The kernel that holds erin's worker while her link's hello waits: it marks its start and its end (files in her
# cache, which the test polls for) around a sleep of this long in poll(2). The window in which the test rotates her
# token (a few hundred milliseconds; asserted below); the test lasts this long at least.
NAP_MS = 3000
NAP_SOURCE = r"""
static long sys4(long n, long a, long b, long c, long d) {
    long r;
    __asm__ volatile("mov %5, %%r10\n\tsyscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c), "r"(d)
                     : "rcx", "r11", "r10", "memory");
    return r;
}
/* openat(AT_FDCWD, path, O_WRONLY | O_CREAT | O_CLOEXEC, 0600), then close */
static void touch(__global const char* path) {
    long fd = sys4(257, -100, (long)path, 01 | 0100 | 02000000, 0600);
    if (fd >= 0) sys4(3, fd, 0, 0, 0);
}
/* marks: the start's path at 0, the end's at 2048; poll(NULL, 0, ms) between */
__kernel void gpb_nap(__global const char* marks, const int ms) {
    touch(marks);
    sys4(7, 0, 0, ms, 0);
    touch(marks + 2048);
}
"""
INNOCENT = "gpb_double"


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    check_arch()
    tmp = tmp_path_factory.mktemp("lifecycle")
    tenants = [TenantSpec("ops", admin=True), TenantSpec("dave"), TenantSpec("erin"), TenantSpec("frank")]
    settings = {"cache_dir": str(tmp / "caches"), "max_sessions_per_tenant": MAX_SESSIONS, "lease_seconds": 60.0}
    with BrokerProcess(tenants, backend="opencl", settings=settings) as proc:
        yield proc


def _cli(*args: str) -> str:
    return subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", *args], capture_output=True, text=True,
                          check=True).stdout


def _reload(broker: BrokerProcess) -> None:
    with AdminClient(broker.target, broker.tokens["ops"]) as admin:
        admin.reload()


def _cache_dir(broker: BrokerProcess) -> Path:
    return Path(str(broker.settings["cache_dir"]))


def _computes(gpu: RemoteGpu, kernel: Kernel) -> np.ndarray:
    x = np.arange(64, dtype=np.float32)
    buf = gpu.allocate_memory(x.nbytes)
    gpu.copy_h2d(x, buf)
    gpu.execute_kernel(kernel, 4, 16, [buf])
    gpu.synchronize()
    out = np.empty_like(x)
    gpu.copy_d2h(buf, out)
    gpu.free_memory(buf)
    return out


def _compiled(broker: BrokerProcess, tenant: str, name: str, worker: int) -> set[Path]:
    """The tenant's compiled ``name.so`` files (PoCL: <hash>/<name>/<wg-size>/<name>.so), as paths in its worker,
    found through the worker's own view of its cache (a tmpfs that reaches the disk only after the worker exits)."""
    root = Path(f"/proc/{worker}/root")
    inside = root / str(_cache_dir(broker)).lstrip("/")
    return {Path("/") / p.relative_to(root) for p in inside.rglob(f"{name}.so")
            if tenant in p.relative_to(inside).parts}


# -- 6: a poisoned cache outlives its tenant -------------------------------------------------------------------------

X = np.arange(64, dtype=np.float32)
INNOCENT_SOURCE = kernel_source(INNOCENT, "x[i] = x[i] * 2.0f + 1.0f;")


def _poison(broker: BrokerProcess, tenant: str) -> tuple[Path, int]:
    """The tenant compiles and runs an innocent kernel, then a look-alike (same name and signature, other code),
    and from inside its worker renames the look-alike's compiled code over the innocent one's in its own cache
    (its to write). Returns the poisoned file and the tenant's worker."""
    with connect(broker.target, token=broker.tokens[tenant], timeout=TIMEOUT) as gpu:
        module = gpu.load_module(ATTACK_SOURCE, ModuleFormat.OPENCL_C)
        attack, addr = gpu.get_kernel(module, "gpb_attack"), gpu.get_kernel(module, "gpb_addr")
        marker = secrets.token_bytes(64)
        buf = gpu.allocate_memory(len(marker))
        gpu.copy_h2d(marker, buf)
        assert broker.process is not None
        worker = find_worker(broker.process.pid, buffer_address(gpu, addr, buf), marker, tenant)
        seen = Path(f"/proc/{worker}/root")
        np.testing.assert_array_equal(_computes(gpu, gpu.compile_kernel(INNOCENT_SOURCE, INNOCENT)), X * 2 + 1)
        (cached,) = _compiled(broker, tenant, INNOCENT, worker)
        evil = gpu.compile_kernel(kernel_source(INNOCENT, "x[i] = 666.0f;"), INNOCENT)
        np.testing.assert_array_equal(_computes(gpu, evil), np.full_like(X, 666.0))
        (planted,) = _compiled(broker, tenant, INNOCENT, worker) - {cached}
        payload = (seen / str(planted).lstrip("/")).read_bytes()
        program = Program()
        program.replace_file(f"rename the look-alike over {cached}", cached, payload)
        (poisoning,) = run(gpu, attack, program)
        assert poisoning.ret >= 0, f"{tenant} could not write its own cache: {poisoning}"
        assert (seen / str(cached).lstrip("/")).read_bytes() == payload, \
            f"the poisoned kernel is not in {tenant}'s cache"
        return cached, worker


def _runs_clean(broker: BrokerProcess, tenant: str) -> None:
    """The tenant's innocent kernel computes what its source says, not its predecessor's planted code."""
    with connect(broker.target, token=broker.tokens[tenant], timeout=TIMEOUT) as gpu:
        out = _computes(gpu, gpu.compile_kernel(INNOCENT_SOURCE, INNOCENT))
    assert not (out == 666.0).all(), "the new tenant ran the code its predecessor planted in the cache"
    np.testing.assert_array_equal(out, X * 2 + 1)


def test_a_tenant_added_again_under_a_removed_ones_name_does_not_run_its_poisoned_cache(broker: BrokerProcess) -> None:
    cached, worker = _poison(broker, "dave")
    _cli("tenant", "remove", "dave", "--config", str(broker.config_path))
    _reload(broker)
    wait_for(lambda: pid_state(worker) in (None, "Z"), 20, "the removed tenant's worker to end")
    # Another tenant, added under the same name with a new token, compiles the same innocent source.
    token = _cli("tenant", "add", "dave", "--config", str(broker.config_path)).strip().splitlines()[-1]
    _reload(broker)
    broker.tokens["dave"] = token
    _runs_clean(broker, "dave")
    # And the removed tenant's cache went with it (the disk it held is free).
    assert not cached.exists(), f"the removed tenant's cache is still there: {cached}"


def test_a_tenant_replaced_while_the_broker_was_down_does_not_run_its_predecessors_cache(tmp_path: Path) -> None:
    """The same, with the name's tenant replaced in the config while no broker ran (a new broker on the same cache
    directory with a new token for the name: what ``tenant remove`` and ``tenant add`` with the broker down leave)."""
    settings = {"cache_dir": str(tmp_path / "caches")}
    with BrokerProcess([TenantSpec("gus")], backend="opencl", settings=settings) as before:
        _poison(before, "gus")
    with BrokerProcess([TenantSpec("gus")], backend="opencl", settings=settings) as after:
        _runs_clean(after, "gus")


# -- 7: a link's hello pending across its token's rotation -----------------------------------------------------------

def _unread(sock: socket.socket) -> int:
    """Bytes this end sent that the peer has not read yet (SIOCOUTQ on a Unix socket)."""
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0])


def _refused(broker: BrokerProcess, token: str) -> bool:
    try:
        list_devices(broker.target, token)
    except Unauthenticated:
        return True
    return False


def test_a_link_hello_pending_behind_a_long_kernel_is_not_served_after_its_tokens_rotation(
        broker: BrokerProcess) -> None:
    old = broker.tokens["erin"]
    # Her commands on gRPC: the hello below is her session's only link (a link of hers already served would have a
    # watch of its own, whose close at the rotation would take the new one with it). Queued commands: the launch
    # and the synchronize go to her worker as one batch, which holds it from the kernel's start to its end.
    gpu = connect(broker.target, token=old, timeout=TIMEOUT, transport="grpc", async_commands=True)
    link: socket.socket | None = None
    try:
        secret = secrets.token_bytes(4096)
        buf = gpu.allocate_memory(len(secret))
        gpu.copy_h2d(secret, buf)
        nap = gpu.compile_kernel(NAP_SOURCE, "gpb_nap")
        # Her worker's /tmp (its own tmpfs, seen from here through /proc/<worker>/root): where the kernel marks its
        # start and end. (Address 0 holds no marker: the worker is found as the one naming her on its command line.)
        assert broker.process is not None
        worker = find_worker(broker.process.pid, 0, secrets.token_bytes(8), "erin")
        inside = [Path("/tmp") / f"nap-{secrets.token_hex(4)}-{what}" for what in ("started", "ended")]
        started, ended = (Path(f"/proc/{worker}/root") / str(p).lstrip("/") for p in inside)
        marks = gpu.allocate_memory(4096)
        gpu.copy_h2d(bytes(inside[0]).ljust(2048, b"\0") + bytes(inside[1]).ljust(2048, b"\0"), marks)

        def nap_in_the_worker() -> None:  # a launch and a synchronize: the worker is held until the kernel ends
            with contextlib.suppress(GpuBrokerError):  # (her stream is cut at the rotation: the kernel runs on)
                gpu.execute_kernel(nap, 1, 1, [marks, np.int32(NAP_MS)])
                gpu.synchronize()

        napping = threading.Thread(target=nap_in_the_worker, daemon=True)
        napping.start()
        wait_for(started.exists, 30, "erin's kernel to start")
        # The hello with her token, while her worker sleeps in the kernel; the front reads (and authenticates) it
        # at once and hands the link to the worker, which takes it only once the kernel is over.
        link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        link.settimeout(TIMEOUT)
        link.connect(broker.target.removeprefix("unix:") + ".fast")
        link.sendall(pack_frame({"token": old, "session": gpu.session, "link": 1}))
        wait_for(lambda: _unread(link) == 0, 10, "the front to read the link's hello")  # (link: not None here)
        # Her token is rotated and the broker reloaded, while the hand-off waits for the worker. (The reload's
        # answer waits for her worker too, which takes its new limits after the kernel: the rotation is seen
        # where it takes effect, the old token refused on gRPC.)
        new = mint_token()
        rotate_token_in_place(broker.config_path, "erin", new.token_id, new.token_hash)
        reloading = threading.Thread(target=_reload, args=(broker,), daemon=True)
        reloading.start()
        wait_for(lambda: _refused(broker, old), 10, "the rotated token to be refused")
        assert not ended.exists(), f"the kernel ended before the rotation: make NAP_MS ({NAP_MS}) longer"
        broker.tokens["erin"] = new.token
        # The rotation retired her worker, which ran the old token's code (front/_retire.py): killed in its kernel.
        wait_for(lambda: not Path(f"/proc/{worker}").exists(), 10, "erin's worker to be retired")
        assert not ended.exists()
        napping.join(TIMEOUT)
        reloading.join(TIMEOUT)
        # What the link gets: the refusal (or its end), never service.
        try:
            _, status, result = recv_frame(link)
        except (ConnectionError, EOFError):
            status, result = 1, {"code": "closed"}
        if status == 0:
            send_payload(link, encode(Batch(1, 0, [Read((buf.handle, 0), 0, len(secret))])))
            ack = decode_ack(recv_payload(link))
            read = ack.result if ack.error is None else None
            pytest.fail(f"a link whose token was rotated while its hello waited was served after the rotation "
                        f"(its read of the tenant's buffer {'returned the buffer' if read == secret else ack})")
        assert result["code"] in ("UNAUTHENTICATED", "ABORTED", "closed"), result
        # Her session ended with her worker, saying why; a session of the new token gets a fresh worker.
        fresh = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with fresh:
            fresh.settimeout(TIMEOUT)
            fresh.connect(broker.target.removeprefix("unix:") + ".fast")
            fresh.sendall(pack_frame({"token": new.token, "session": gpu.session, "link": 1}))
            _, status, result = recv_frame(fresh)
            assert status != 0 and "revoked (token rotated)" in result["message"], result
        with connect(broker.target, token=new.token, timeout=TIMEOUT, transport="grpc") as again:
            again.allocate_memory(4096)
    finally:
        if link is not None:
            link.close()
        gpu.close()  # (its token was rotated: best-effort, the lease ends the session)


# -- 8: the session cap under concurrency ----------------------------------------------------------------------------

def test_concurrent_opens_get_no_more_sessions_than_the_cap(broker: BrokerProcess) -> None:
    channel, metadata = make_channel(broker.target, broker.tokens["frank"])
    stub = pb_grpc.GpuBrokerStub(channel)
    try:
        # Frank has no worker: every call waits for the one worker start, at once.
        calls = [stub.OpenSession.future(pb.OpenSessionRequest(device=0), metadata=metadata, timeout=TIMEOUT)
                 for _ in range(16)]
        opened, refused = [], []
        for call in calls:
            try:
                opened.append(call.result().session)
            except grpc.RpcError as err:
                refused.append(err.code())
        try:
            assert len(opened) == MAX_SESSIONS, f"{len(opened)} sessions against a cap of {MAX_SESSIONS}"
            assert refused == [grpc.StatusCode.RESOURCE_EXHAUSTED] * (16 - MAX_SESSIONS), refused
        finally:
            for session in opened:
                stub.CloseSession(pb.SessionRequest(session=session), metadata=metadata, timeout=TIMEOUT)
        # The places are free again: as many new sessions as the cap, no more.
        more = [stub.OpenSession(pb.OpenSessionRequest(device=0), metadata=metadata, timeout=TIMEOUT).session
                for _ in range(MAX_SESSIONS)]
        with pytest.raises(grpc.RpcError) as refused_one:
            stub.OpenSession(pb.OpenSessionRequest(device=0), metadata=metadata, timeout=TIMEOUT)
        assert refused_one.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for session in more:
            stub.CloseSession(pb.SessionRequest(session=session), metadata=metadata, timeout=TIMEOUT)
    finally:
        channel.close()
