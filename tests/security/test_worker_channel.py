"""The front trusts nothing a worker says and bounds what it holds for each worker (issue 21, round 2).

Each test here is an attacker's reproducer: a tenant's kernel runs inside its worker (PoCL: native code) and takes
over the worker's request socket to the front, or leaves the worker unable to read it.

- A reply is decoded against the schema of the request it answers, never as arbitrary msgpack: an error reply
  padded with millions of empty arrays (~64x its size as Python objects) is a lie, found before it is built, and
  the worker is killed for it and charged to its tenant.
- A worker's error message is escaped where the front takes it (``error_from_worker``): a newline in it cannot
  put a forged line into the front's log.
- A session's links are counted by the front (the worker's cap is its tenant's to break): past 8 being handed
  over or relayed, a hello is refused at once, and a hand-off the worker does not complete in
  link_handoff_timeout_seconds is refused, the worker told to drop it when it wakes.
- Requests to a worker that does not read (its kernel sleeps) wait for room before they are written: a caller
  that gives up leaves nothing in the front; the bytes waiting are capped (RESOURCE_EXHAUSTED past
  worker_send_buffer_bytes), and a worker that reads none of them for worker_write_stall_seconds is killed.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import GpuBrokerError, ModuleFormat, RemoteGpu, connect

from ..helpers import descendants, proc_status, recv_payload, send_payload, wait_for
from .exploits import check_arch

# Each test's attacker is a tenant of its own: a worker killed for a lie counts against its tenant's crash budget.
TENANTS = ["bomber", "victim", "forger", "sleeper", "linker"]
SEND_BUFFER = 5 * 1024 * 1024
# (past the flood below, FLOOD_SECONDS at most and ~3.3 s on a 2-core VM: what the front holds is measured while the
# worker still lives)
WRITE_STALL = 9.0
# (longer than the links test takes to count the threads, ~0 s and at most this less 2: the hand-offs still wait then)
HANDOFF_TIMEOUT = 5.0

# -- the kernel that takes over its worker's request socket ---------------------------------------------------------
TAKEOVER_SOURCE = r"""
static long sys3(long n, long a, long b, long c) {
    long r;
    __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c) : "rcx", "r11", "memory");
    return r;
}
static long io_all(long nr, int fd, __global uchar* p, long n) {  /* read (0) or write (1) exactly n bytes */
    long done = 0;
    while (done < n) {
        long k = sys3(nr, fd, (long)(p + done), n - done);
        if (k <= 0) return k < 0 ? k : -1;
        done += k;
    }
    return done;
}
/* rounds x: read one request [id, op, session, params] from the front, answer [id, 1, tail] (tail: the error). */
/* (Lease messages, id -1, are read and dropped.) */
__kernel void gpb_bomb(const int fd, const int rounds, __global uchar* buf, __global uchar* tail, const long tail_len,
                       __global long* res) {
    for (int r = 0; r < rounds; ++r) {
        long k = io_all(0, fd, buf, 4);
        if (k < 0) { res[r] = k; return; }
        long len = ((long)buf[0] << 24) | ((long)buf[1] << 16) | ((long)buf[2] << 8) | (long)buf[3];
        if (len > 65000) { res[r] = -7; return; }
        k = io_all(0, fd, buf + 4, len);
        if (k < 0) { res[r] = k; return; }
        uchar b = buf[5];   /* buf[4] is the request's 0x94; then its id */
        if (b >= 0xe0) { --r; continue; }   /* a lease message (id -1) from the scheduler: no answer is due */
        long idlen = b < 0x80 ? 1 : b == 0xcc ? 2 : b == 0xcd ? 3 : b == 0xce ? 5 : 9;
        __global uchar* head = buf + 65536;
        long total = 1 + idlen + tail_len;
        head[0] = total >> 24; head[1] = total >> 16; head[2] = total >> 8; head[3] = total;
        head[4] = 0x93;
        for (long i = 0; i < idlen; ++i) head[5 + i] = buf[5 + i];
        k = io_all(1, fd, head, 5 + idlen);
        if (k >= 0) k = io_all(1, fd, tail, tail_len);
        res[r] = k;
    }
}
"""


def _str(text: str) -> bytes:
    return bytes([0xA0 | len(text)]) + text.encode()


ROUNDS = 3
PAD = 5 * 1024 * 1024 - 4096  # empty arrays in one reply: the frame stays under the front's 5 MiB bound
ALLOWED_GROWTH = 64 * 1024 * 1024  # a few frames' worth
BOMB_TAIL = (b"\x01\x83" + _str("code") + _str("INTERNAL") + _str("message") + _str("x") + _str("pad")
             + b"\xdd" + struct.pack(">I", PAD) + b"\x90" * PAD)

FORGED = "2026-11-27 04:00:00,000 gpubroker.audit INFO admin=ops action=end-session session=ses_forged tenant=bob"
FORGE_TAIL = b"\x01" + msgpack.packb({"code": "RESOURCE_EXHAUSTED", "message": "no room\n" + FORGED})


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    check_arch()
    tmp = tmp_path_factory.mktemp("channel")
    with BrokerProcess([TenantSpec(name) for name in TENANTS], backend="opencl",
                       settings={"cache_dir": str(tmp / "caches"), "worker_send_buffer_bytes": SEND_BUFFER,
                                 "worker_write_stall_seconds": WRITE_STALL, "link_listen": "127.0.0.1:0",
                                 "link_handoff_timeout_seconds": HANDOFF_TIMEOUT}) as broker:
        yield broker


def _front_fd(front: int, tenant: str) -> int:
    """The worker's end of its request socket (``--fd N`` on its command line), as the attacker would read it."""
    for pid in descendants(front):
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if "gpubroker.broker.worker" in args and tenant in args and args[0].endswith("python"):
            return int(args[args.index("--fd") + 1])
    raise AssertionError(f"no worker of {tenant} under the front")


def _take_over(gpu: RemoteGpu, front: int, tenant: str, tail: bytes, rounds: int) -> tuple[RemoteGpu, Any]:
    """Launch the takeover kernel in ``gpu``'s worker: it answers the next ``rounds`` requests with ``tail``."""
    kernel = gpu.get_kernel(gpu.load_module(TAKEOVER_SOURCE, ModuleFormat.OPENCL_C), "gpb_bomb")
    fd = _front_fd(front, tenant)
    buf, dev_tail, res = gpu.allocate_memory(131072), gpu.allocate_memory(len(tail)), gpu.allocate_memory(8 * rounds)
    gpu.copy_h2d(np.frombuffer(tail, dtype=np.uint8), dev_tail)
    gpu.execute_kernel(kernel, 1, 1, [np.int32(fd), np.int32(rounds), buf, dev_tail, np.int64(len(tail)), res])
    return gpu, res


def _slowest_call(gpu: RemoteGpu, until: concurrent.futures.Future[Any]) -> float:
    slowest = 0.0
    while not until.done():
        start = time.monotonic()
        gpu.free_memory(gpu.allocate_memory(16))
        slowest = max(slowest, time.monotonic() - start)
    return slowest


def _hwm(pid: int) -> int:
    return int(proc_status(pid)["VmHWM"].split()[0]) * 1024


def _log_lines(broker: BrokerProcess) -> list[str]:
    return broker.log_path.read_text(errors="replace").splitlines()


def _synchronized(gpu: RemoteGpu) -> str:
    try:
        gpu.synchronize()
        return "synchronized"
    except GpuBrokerError as exc:
        return f"{type(exc).__name__}: {exc.message}"


def test_a_reply_of_another_shape_is_refused_before_it_is_built_and_its_worker_killed(broker: BrokerProcess) -> None:
    assert broker.process is not None
    front = broker.process.pid
    attacker = connect(broker.target, token=broker.tokens["bomber"], timeout=60)
    caller = connect(broker.target, token=broker.tokens["bomber"], timeout=60, transport="grpc", shared_memory=False)
    victim = connect(broker.target, token=broker.tokens["victim"], timeout=60, transport="grpc", shared_memory=False)
    with contextlib.closing(attacker), contextlib.closing(caller), contextlib.closing(victim), \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        base = _hwm(front)
        _take_over(attacker, front, "bomber", BOMB_TAIL, ROUNDS)
        running = pool.submit(_synchronized, attacker)
        slowest = pool.submit(_slowest_call, victim, running)  # another tenant's small calls meanwhile
        answers = []
        for _ in range(ROUNDS):
            try:
                caller.allocate_memory(16)
                answers.append("allocated")
            except GpuBrokerError as exc:
                answers.append(f"{type(exc).__name__}: {exc.message}")
        wait_for(running.done, timeout=60, what="the attacker's kernel")
        grown = _hwm(front) - base
        synchronized = running.result()
    print(f"\nanother tenant's slowest Allocate+Free meanwhile: {slowest.result():.2f} s; the front's peak memory grew "
          f"by {grown / 2**20:.0f} MiB; answers {answers}; the attacker's own session: {synchronized}")
    assert grown <= ALLOWED_GROWTH, f"{len(BOMB_TAIL) >> 20} MiB worker replies grew the front by {grown >> 20} MiB"
    # The first padded reply is a lie (a key no error has): the worker is killed, its tenant's callers told why.
    assert answers[0].startswith("WorkerCrashed") and "broke the front's protocol" in answers[0], answers
    assert "unknown field" in answers[0], answers
    assert synchronized.startswith("WorkerCrashed"), synchronized
    assert not any("Traceback" in line for line in _log_lines(broker))


def test_a_workers_error_message_cannot_forge_a_line_in_the_fronts_log(broker: BrokerProcess) -> None:
    assert broker.process is not None and broker.workdir is not None
    # (10 s: the kernel may take the synchronize request itself, which then gets no answer)
    gpu = connect(broker.target, token=broker.tokens["forger"], timeout=10, transport="grpc", shared_memory=False)
    with contextlib.closing(gpu), concurrent.futures.ThreadPoolExecutor(1) as pool:
        _take_over(gpu, broker.process.pid, "forger", FORGE_TAIL, 1)
        running = pool.submit(_synchronized, gpu)
        # A link hello for the tenant's own session: the front asks the worker to attach it, and logs its refusal.
        with socket.socket(socket.AF_UNIX) as link:
            link.settimeout(5)
            link.connect(str(broker.workdir / "broker.sock.fast"))
            send_payload(link, msgpack.packb({"token": broker.tokens["forger"], "session": gpu.session, "link": 1}))
            with contextlib.suppress(OSError):
                link.recv(4096)  # the front's refusal, which carries the worker's error
        wait_for(running.done, timeout=60, what="the attacker's kernel")
    wait_for(lambda: any("no room" in line for line in _log_lines(broker)), timeout=10, what="the front's log line")
    forged = [line for line in _log_lines(broker) if line.startswith(FORGED)]
    context = [line for line in _log_lines(broker) if "no room" in line]
    print(f"\nthe front's line: {context}\nforged lines in the broker's log: {forged}")
    assert not forged, f"a worker's error message put a whole forged line into the front's log: {forged}"
    assert any("no room\\n" + FORGED in line for line in context), context  # there, escaped, on the front's line


SLEEP_SECONDS = 30
SLEEP_SOURCE = r"""
__kernel void gpb_sleep(__global long* ts) {
    long r;
    __asm__ volatile("syscall" : "=a"(r) : "a"(35L), "D"((long)ts), "S"(0L) : "rcx", "r11", "memory");
    ts[2] = r;
}
"""


def _sleep(gpu: RemoteGpu, seconds: int) -> None:
    """A kernel that parks the worker in nanosleep: it reads nothing from the front meanwhile."""
    kernel = gpu.get_kernel(gpu.load_module(SLEEP_SOURCE, ModuleFormat.OPENCL_C), "gpb_sleep")
    ts = gpu.allocate_memory(24)
    gpu.copy_h2d(np.array([seconds, 0, 1], dtype=np.int64), ts)
    gpu.execute_kernel(kernel, 1, 1, [ts])


def _rss(pid: int) -> int:
    return int(proc_status(pid)["VmRSS"].split()[0]) * 1024


FLOOD_CALLS = 50  # per flooding session
FLOOD_SECONDS = 6.0  # the flood stops then at the latest, well before WRITE_STALL
FLOODERS = 4
MODULE_BYTES = 2 * 1024 * 1024 - 4096
# Honest in-flight state: the calls waiting (each holds its request a few times over as it is decoded and encoded)
# and what the allocator keeps of them (gRPC's threads' arenas), which does not grow with the flood: measured 17-144
# MiB across runs on a loaded 2-core machine, 215 in one full run with other work beside it, 349 in another (its
# flood the fastest, 2.9 s; 162-247 alone in the same clone right after). Without the fix every given-up request
# stayed queued toward the worker: 290-300 MiB for half this flood (25 calls a session), twice that for this one.
# The bound sits between the two.
FLOOD_GROWTH = 448 * 1024 * 1024


def test_requests_to_a_worker_that_does_not_read_are_bounded_and_the_worker_killed(broker: BrokerProcess) -> None:
    assert broker.process is not None
    front = broker.process.pid
    sleeper = connect(broker.target, token=broker.tokens["sleeper"], timeout=SLEEP_SECONDS * 4)
    flooders = [connect(broker.target, token=broker.tokens["sleeper"], timeout=0.3, transport="grpc",
                        shared_memory=False) for _ in range(FLOODERS)]
    with contextlib.ExitStack() as stack, concurrent.futures.ThreadPoolExecutor(1 + FLOODERS) as pool:
        stack.enter_context(contextlib.closing(sleeper))
        for flooder in flooders:
            stack.enter_context(contextlib.closing(flooder))
        _sleep(sleeper, SLEEP_SECONDS)
        started = time.monotonic()
        asleep = pool.submit(_synchronized, sleeper)
        base = _rss(front)
        source = "/*" + "x" * (MODULE_BYTES - 4) + "*/"

        def flood(flooder: RemoteGpu) -> list[str]:
            errors = []
            for _ in range(FLOOD_CALLS):
                if asleep.done() or time.monotonic() - started > FLOOD_SECONDS:  # (measured while it sleeps)
                    break
                try:
                    flooder.load_module(source, ModuleFormat.OPENCL_C)
                except GpuBrokerError as exc:
                    errors.append(f"{type(exc).__name__}: {exc.message}")
            return errors

        errors = [error for errors in pool.map(flood, flooders) for error in errors]
        flooding = time.monotonic() - started
        for flooder in flooders:  # (their connections' own buffers go with them)
            flooder.close()
        grown = _rss(front) - base
        measured_asleep = not asleep.done()
        wait_for(asleep.done, timeout=SLEEP_SECONDS * 3, what="the sleeping kernel")
        ended = time.monotonic() - started
    refused = [error for error in errors if "worker_send_buffer_bytes" in error]
    print(f"\n{len(errors)} module loads of {MODULE_BYTES / 2**20:.0f} MiB failed while the worker slept "
          f"({len(refused)} refused for room, e.g. {refused[:1]}); the front grew by {grown / 2**20:.0f} MiB; "
          f"(flooded for {flooding:.1f} s, measured with the worker {'alive' if measured_asleep else 'gone'}); "
          f"the sleeping session after {ended:.1f} s: {asleep.result()}")
    assert measured_asleep, "the flood outlasted worker_write_stall_seconds: nothing measured what waits toward it"
    assert grown <= FLOOD_GROWTH, f"requests to a worker that was not reading grew the front by {grown >> 20} MiB"
    assert refused and all(error.startswith("ResourceExhausted") for error in refused), errors[:3]
    # The worker read nothing for WRITE_STALL seconds while requests waited: killed, well before its kernel ended.
    assert asleep.result().startswith("ResourceExhausted") and "worker_write_stall_seconds" in asleep.result()
    assert ended < SLEEP_SECONDS, f"the worker was left to sleep {ended:.1f} s with requests waiting"


LINKS = 64
LINKS_ALLOWED = 8 * 3  # the per-session cap, with some room (a thread and a few descriptors each)
LINK_SLEEP_SECONDS = 8  # past HANDOFF_TIMEOUT (from the hellos, sent as it starts), so the hand-offs time out


def _counts(pid: int) -> tuple[int, int]:
    return int(proc_status(pid)["Threads"]), len(list(Path(f"/proc/{pid}/fd").iterdir()))


def _answer(sock: socket.socket) -> str:
    """The link hello's answer: the worker's acceptance, or the front's refusal's status and message."""
    try:
        _, status, result = msgpack.unpackb(recv_payload(sock))
    except (OSError, ValueError) as exc:
        return f"no answer ({type(exc).__name__})"
    return "accepted" if status == 0 else f"{result['code']}: {result['message']}"


def test_a_sessions_links_are_bounded_by_the_front(broker: BrokerProcess) -> None:
    assert broker.process is not None
    front = broker.process.pid
    gpu = connect(broker.target, token=broker.tokens["linker"], timeout=LINK_SLEEP_SECONDS * 4, transport="grpc",
                  shared_memory=False)
    with contextlib.closing(gpu), concurrent.futures.ThreadPoolExecutor(1) as pool, contextlib.ExitStack() as links:
        _sleep(gpu, LINK_SLEEP_SECONDS)
        asleep = pool.submit(_synchronized, gpu)
        threads0, fds0 = _counts(front)
        hello = msgpack.packb({"token": broker.tokens["linker"], "session": gpu.session, "link": 1})
        socks = []
        started = time.monotonic()
        for _ in range(LINKS):
            sock = links.enter_context(socket.create_connection(("127.0.0.1", broker.link_port), timeout=10))
            send_payload(sock, hello)
            socks.append(sock)
        # The count is read once the refusals are out (their threads end) and while the 8 hand-offs still wait
        # (HANDOFF_TIMEOUT from the first hellos): a front holding a thread per link shows 64 until then. On a
        # loaded machine all 64 threads may exist for a moment before the front judges the hellos.
        deadline = started + HANDOFF_TIMEOUT - 2

        def settled() -> bool:
            threads, fds = _counts(front)
            return threads - threads0 <= LINKS_ALLOWED and fds - fds0 <= 3 * LINKS_ALLOWED

        with contextlib.suppress(AssertionError):
            wait_for(settled, timeout=max(0.5, deadline - time.monotonic()), what="the refused links' threads")
        threads, fds = _counts(front)
        answers = [_answer(sock) for sock in socks]
        still_asleep = not asleep.done()
        links.close()
        wait_for(asleep.done, timeout=LINK_SLEEP_SECONDS * 3, what="the sleeping kernel")
        # Awake, the worker drops the links whose hand-off timed out; then the session's places are free again.
        with socket.create_connection(("127.0.0.1", broker.link_port), timeout=10) as sock:
            send_payload(sock, hello)
            after = _answer(sock)
    refused = [a for a in answers if a.startswith("RESOURCE_EXHAUSTED")]
    timed_out = [a for a in answers if a.startswith("UNAVAILABLE") and "link_handoff_timeout_seconds" in a]
    print(f"\n{LINKS} link hellos for one session while its worker slept ({still_asleep}): the front went from "
          f"{threads0} to {threads} threads and from {fds0} to {fds} descriptors; {len(refused)} refused at once "
          f"(e.g. {refused[:1]}), {len(timed_out)} timed out (e.g. {timed_out[:1]}); once awake: {after}")
    assert threads - threads0 <= LINKS_ALLOWED and fds - fds0 <= 3 * LINKS_ALLOWED, (
        f"{LINKS} links of one session hold {threads - threads0} front threads and {fds - fds0} descriptors")
    # The 8 within the cap wait for the worker: refused at link_handoff_timeout_seconds while it sleeps, or taken if
    # its main thread served them before it sat down to wait for the kernel (PoCL runs kernels on threads of its
    # own: on a loaded machine the hellos may come first). Either way the front held 8 at most.
    accepted = [a for a in answers if a == "accepted"]
    assert len(refused) == LINKS - 8 and len(timed_out) + len(accepted) == 8, answers
    assert after == "accepted", after
