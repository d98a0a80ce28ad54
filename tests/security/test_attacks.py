"""A hostile tenant attacks from inside a kernel, with real exploits, on PoCL (issue 12's acceptance).

Alice's kernel gets a system-call primitive (inline asm ``syscall``) and raw pointer access, and tries to read and
write another tenant's worker memory, read the front's memory and environment, open the config, a TLS key and
another tenant's compile cache, signal the front and another worker, replace another tenant's compiled kernel, and
open network sockets. Each attempt's return value (a negative errno when refused) comes back and is printed; every
attempt must fail, leak nothing, and leave the victim's data and service and the front intact. How the sandbox
refuses does not matter (EPERM from seccomp, ENOENT for a path it does not mount, ESRCH for a pid outside the
worker's pid namespace, EACCES): only "refused, and nothing leaked".

``GPB_EXPECT_VULNERABLE=1`` flips the assertions: every attempt must then get through. Run that way against an
unsandboxed broker, it proves each exploit really works, so that their failing under the sandbox means something.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker.config import TlsConfig
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import Buffer, GpuBrokerError, Kernel, ModuleFormat, RemoteGpu, connect

from ..helpers import wait_for
from .exploits import (
    AF_INET,
    AF_UNIX,
    ATTACK_SOURCE,
    O_WRONLY,
    SIGKILL,
    SIGSTOP,
    SKIPPED,
    VICTIM_SOURCE,
    Attempt,
    Program,
    buffer_address,
    cached_kernels,
    check_arch,
    find_worker,
    kernel_source,
    pid_state,
    run,
    sockaddr_in,
    sockaddr_un,
    stack_range,
)

VULNERABLE = os.environ.get("GPB_EXPECT_VULNERABLE") == "1"
TENANTS = [TenantSpec("alice"), TenantSpec("bob"), TenantSpec("carol")]
TIMEOUT = 30.0  # every client call is bounded: a stopped front must fail a test, never hang it


@dataclass
class Tenant:
    gpu: RemoteGpu
    kernels: dict[str, Kernel]
    pid: int  # its worker, found from outside by the contents of one of its buffers


@dataclass
class World:
    broker: BrokerProcess
    secret: str  # in the broker's environment only
    tls_dir: Path
    cache_dir: Path
    attacker: Tenant  # alice
    victim: Tenant  # bob

    @property
    def front(self) -> int:
        assert self.broker.process is not None
        return self.broker.process.pid


def _open(broker: BrokerProcess, tenant: str, source: str, names: tuple[str, ...]) -> Tenant:
    gpu = connect(broker.target, token=broker.tokens[tenant], timeout=TIMEOUT)
    module = gpu.load_module(source, ModuleFormat.OPENCL_C)
    kernels = {name: gpu.get_kernel(module, name) for name in names}
    marker = secrets.token_bytes(64)
    buf = gpu.allocate_memory(len(marker))
    gpu.copy_h2d(marker, buf)
    assert broker.process is not None
    pid = find_worker(broker.process.pid, buffer_address(gpu, kernels["gpb_addr"], buf), marker, tenant)
    gpu.free_memory(buf)
    return Tenant(gpu, kernels, pid)


def _settings(tmp: Path) -> dict[str, object]:
    # worker_idle_seconds: a victim whose sessions all ended gets a fresh worker soon (the cache test needs one).
    return {"cache_dir": str(tmp / "caches"), "worker_idle_seconds": 1.0, "lease_seconds": 60.0}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    check_arch()
    tmp = tmp_path_factory.mktemp("attacks")
    from gpubroker.broker.certs import init_certs  # (cryptography: absent from the bare GPU image)

    ca, server = init_certs(tmp / "tls")  # what `gpubroker certs init` writes
    tls = TlsConfig(cert_file=str(server.cert), key_file=str(server.key), client_ca_file=str(ca.cert),
                    require_client_cert=True)
    secret = f"gpb-secret-{secrets.token_hex(16)}"
    with BrokerProcess(TENANTS, backend="opencl", tcp=["127.0.0.1:0"], settings={**_settings(tmp), "tls": tls},
                       env={"GPB_ATTACK_SECRET": secret}) as broker, contextlib.ExitStack() as sessions:
        attacker = _open(broker, "alice", ATTACK_SOURCE, ("gpb_attack", "gpb_addr"))
        sessions.callback(attacker.gpu.close)
        victim = _open(broker, "bob", VICTIM_SOURCE, ("gpb_addr", "gpb_scale"))
        sessions.callback(victim.gpu.close)
        yield World(broker, secret, tmp / "tls", tmp / "caches", attacker, victim)


# -- checks ----------------------------------------------------------------------------------------------------------

def check(attempts: list[Attempt], what: str) -> None:
    """Every attempt refused and nothing leaked (or, with GPB_EXPECT_VULNERABLE=1, every one through)."""
    table = "\n".join(f"  {a}" for a in attempts)
    print(f"\n{what}:\n{table}")
    if VULNERABLE:
        held = [a for a in attempts if not a.succeeded]
        assert not held, f"expected every attack to get through today, but some were held:\n{table}"
    else:
        through = [a for a in attempts if a.succeeded]
        assert not through, f"{len(through)} of {len(attempts)} attacks got through:\n{table}"


def plant(tenant: Tenant, n: int = 4096) -> tuple[Buffer, bytes, int]:
    """A buffer of random bytes in the tenant's worker: what an attacker wants; returns it, its bytes, its address."""
    data = secrets.token_bytes(n)
    buf = tenant.gpu.allocate_memory(n)
    tenant.gpu.copy_h2d(data, buf)
    return buf, data, buffer_address(tenant.gpu, tenant.kernels["gpb_addr"], buf)


def contents(gpu: RemoteGpu, buf: Buffer) -> bytes:
    out = bytearray(buf.size)
    gpu.copy_d2h(buf, out)
    return bytes(out)


def assert_serves(broker: BrokerProcess, tenant: Tenant) -> None:
    """The front is alive and the tenant's launch + copy back computes the right thing."""
    assert broker.process is not None and broker.process.poll() is None, "the front died"
    x = np.arange(1024, dtype=np.float32)
    buf = tenant.gpu.allocate_memory(x.nbytes)
    tenant.gpu.copy_h2d(x, buf)
    tenant.gpu.execute_kernel(tenant.kernels["gpb_scale"], 4, 256, [buf, np.float32(3), np.int32(x.size)])
    tenant.gpu.synchronize()
    out = np.empty_like(x)
    tenant.gpu.copy_d2h(buf, out)
    tenant.gpu.free_memory(buf)
    np.testing.assert_array_equal(out, x * 3 + 1)


def launch(attacker: Tenant, program: Program) -> list[Attempt]:
    """Run the attacker's program. Its worker must live through it: a refusal is an errno the kernel reports (a
    seccomp filter returning EPERM, say), so the test knows which attempt was refused and how."""
    try:
        return run(attacker.gpu, attacker.kernels["gpb_attack"], program)
    except GpuBrokerError as exc:
        raise AssertionError(f"the attacker's launch failed ({exc!r}): a refused call must return an errno, not end "
                             "the worker, or nobody can tell which attempts were refused") from exc


def attack(world: World, program: Program, what: str) -> list[Attempt]:
    attempts = launch(world.attacker, program)
    check(attempts, what)
    return attempts


# -- the tests -------------------------------------------------------------------------------------------------------

def test_the_exploit_primitives_work_and_a_refused_call_does_not_crash_the_attacker(world: World) -> None:
    """The control: system calls and raw pointers work in the attacker's worker (sandboxed or not), and a failed
    call returns its errno and skips what depended on it, so "refused" elsewhere is the sandbox's doing."""
    own, marker, addr = plant(world.attacker, 64)
    program = Program()
    pid = program.getpid("getpid")
    missing = program.read_file("open a path that does not exist", "/nonexistent/gpb-attack", 16)
    raw = program.copy_raw("read its own buffer through a raw pointer", addr, 64)
    launch(world.attacker, program)
    print(f"\ncontrol:\n  {pid}\n  {missing}\n  {raw}")
    assert pid.ret > 0
    assert missing.results[0] < 0 and missing.results[1] == SKIPPED, "the read after a failed open must be skipped"
    assert raw.data == marker
    # The worker lives on after the failed call: it runs the next program too.
    again = Program()
    again.getpid("getpid")
    assert launch(world.attacker, again)[0].ret == pid.ret
    world.attacker.gpu.free_memory(own)


def test_cannot_read_or_write_another_tenants_worker_memory(world: World) -> None:
    buf, data, addr = plant(world.victim)
    victim = find_worker(world.front, addr, data[:64], "bob")  # bob's worker holds the buffer at that address
    mem = f"/proc/{victim}/mem"
    program = Program()
    program.read_file(f"pread {mem} at bob's buffer", mem, 256, offset=addr, secret=data[:256])
    program.vm_read("process_vm_readv bob's buffer", victim, addr + 256, 256, secret=data[256:512])
    program.ptrace_peek("ptrace(SEIZE) bob's worker and PEEKDATA his buffer", victim, addr + 512,
                        secret=data[512:520])
    program.write_file(f"pwrite {mem} at bob's buffer", mem, b"PWNED-BY-PROC-MEM", offset=addr + 1024)
    program.vm_write("process_vm_writev bob's buffer", victim, addr + 2048, b"PWNED-BY-VM-WRITEV")
    attack(world, program, "another tenant's worker memory")
    after = contents(world.victim.gpu, buf)
    if VULNERABLE:
        assert after[1024:1041] == b"PWNED-BY-PROC-MEM" and after[2048:2066] == b"PWNED-BY-VM-WRITEV"
    else:
        assert after == data, "the victim's device buffer changed"
        assert_serves(world.broker, world.victim)
    world.victim.gpu.free_memory(buf)


def test_cannot_read_the_fronts_memory(world: World) -> None:
    front = world.front
    try:
        maps = Path(f"/proc/{front}/maps").read_text()
        elf = int(maps.split("-", 1)[0], 16)  # the first mapping: the interpreter's ELF header
        stack = stack_range(maps)
        assert stack is not None
        # Where the secret sits in the front's memory (its environment, at the top of its stack), found from outside.
        with open(f"/proc/{front}/mem", "rb", buffering=0) as mem:
            top = os.pread(mem.fileno(), stack[1] - stack[0], stack[0])
        where = stack[0] + top.index(world.secret.encode())
        first_line = maps.splitlines()[0].encode()
    except PermissionError:
        # A front that made itself undumpable hides its layout from this (unprivileged) test too: aim at the
        # attacker's own layout, which the same binary shares but for ASLR; what is read must still not be secret.
        maps = Path(f"/proc/{world.attacker.pid}/maps").read_text()
        elf = where = int(maps.split("-", 1)[0], 16)
        first_line = b"[stack]"
    program = Program()
    program.read_file(f"pread /proc/{front}/mem (the front's ELF header)", f"/proc/{front}/mem", 4, offset=elf,
                      secret=b"\x7fELF")
    program.read_file(f"pread /proc/{front}/mem (the secret in the front)", f"/proc/{front}/mem", len(world.secret),
                      offset=where, secret=world.secret.encode())
    program.vm_read("process_vm_readv the front", front, where, len(world.secret), secret=world.secret.encode())
    program.read_file(f"read /proc/{front}/maps", f"/proc/{front}/maps", 4096, secret=first_line)
    attack(world, program, "the front's memory")
    assert_serves(world.broker, world.victim)


def test_cannot_read_the_brokers_environment(world: World) -> None:
    secret = world.secret.encode()
    program = Program()
    program.read_file(f"read /proc/{world.front}/environ (the front's)", f"/proc/{world.front}/environ", 1 << 16,
                      secret=secret)
    program.read_file(f"read /proc/{world.victim.pid}/environ (bob's worker's)", f"/proc/{world.victim.pid}/environ",
                      1 << 16, secret=secret)
    # Its own environment is the attacker's to read; the broker's secret must simply not be in it.
    program.read_file("read /proc/self/environ (its own)", "/proc/self/environ", 1 << 16, must_fail=False,
                      secret=secret)
    attempts = launch(world.attacker, program)
    # The environment execve left at the top of its own stack, read through raw pointers.
    maps = Program()
    listing = maps.read_file("read /proc/self/maps", "/proc/self/maps", 1 << 19, must_fail=False)
    launch(world.attacker, maps)
    stack = stack_range(listing.data.decode(errors="replace"))
    if stack is None:  # no /proc inside: the test tells the attacker where its stack is (it could guess)
        stack = stack_range(Path(f"/proc/{world.attacker.pid}/maps").read_text())
    assert stack is not None
    size = min(stack[1] - stack[0], 1 << 20)
    raw = Program()
    raw.copy_raw(f"raw read of its own stack top ({size} bytes)", stack[1] - size, size, secret=secret)
    attempts += launch(world.attacker, raw)
    check(attempts, "the broker's environment")


def test_cannot_open_the_config_or_a_tls_key(world: World) -> None:
    config = world.broker.config_path
    token_hash = re.search(rb'token_hash = "([^"]+)"', config.read_bytes())
    assert token_hash is not None
    server_key, ca_key = world.tls_dir / "server.key", world.tls_dir / "ca.key"
    program = Program()
    program.read_file(f"read the config {config}", config, 1 << 16, secret=token_hash.group(1))
    program.read_file(f"read the TLS key {server_key}", server_key, 4096, secret=server_key.read_bytes()[:64])
    program.read_file(f"read the CA key {ca_key}", ca_key, 4096, secret=ca_key.read_bytes()[:64])
    program.list_dir(f"list the broker's directory {config.parent}", config.parent, secret=b"gpubroker.toml")
    # The same files through the front's own view of the filesystem, and the front's open descriptors.
    program.read_file(f"read the config through /proc/{world.front}/root", f"/proc/{world.front}/root{config}",
                      1 << 16, secret=token_hash.group(1))
    program.list_dir(f"list the front's descriptors /proc/{world.front}/fd", f"/proc/{world.front}/fd")
    attack(world, program, "the config and TLS keys")
    assert_serves(world.broker, world.victim)


def test_cannot_read_or_replace_another_tenants_compiled_kernel(world: World) -> None:
    """Carol's innocent kernel is compiled into her cache; alice tries to read it and to rename her own look-alike
    (same name, same signature, different code) over it. Carol's next worker must still compute the right thing."""
    broker, name = world.broker, f"innocent_{secrets.token_hex(6)}"  # a fresh cache entry on every run
    innocent = VICTIM_SOURCE + kernel_source(name, "x[i] = x[i] * 2.0f + 1.0f;")
    x = np.arange(64, dtype=np.float32)

    def computes(tenant: Tenant, kernel: Kernel) -> np.ndarray:
        buf = tenant.gpu.allocate_memory(x.nbytes)
        tenant.gpu.copy_h2d(x, buf)
        tenant.gpu.execute_kernel(kernel, 4, 16, [buf])
        tenant.gpu.synchronize()
        out = np.empty_like(x)
        tenant.gpu.copy_d2h(buf, out)
        tenant.gpu.free_memory(buf)
        return out

    carol = _open(broker, "carol", innocent, ("gpb_addr", name))
    np.testing.assert_array_equal(computes(carol, carol.kernels[name]), x * 2 + 1)
    victim_entries = cached_kernels(carol.pid, name, [world.cache_dir / "carol"])
    assert len(victim_entries) == 1, f"carol's compiled {name} not found in her cache: {victim_entries}"
    (victim_paths,) = victim_entries.values()  # its host path first, then through carol's mount namespace
    original = victim_paths[0].read_bytes()
    # Alice compiles and runs her look-alike, so that she holds a compiled .so to plant.
    evil = world.attacker.gpu.compile_kernel(kernel_source(name, "x[i] = 666.0f;"), name)
    np.testing.assert_array_equal(computes(world.attacker, evil), np.full_like(x, 666.0))
    evil_entries = {k: v for k, v in cached_kernels(world.attacker.pid, name, [world.cache_dir / "alice"]).items()
                    if k not in victim_entries}
    assert len(evil_entries) == 1, f"alice's compiled {name} not found in her cache: {evil_entries}"
    (evil_paths,) = evil_entries.values()
    payload = evil_paths[0].read_bytes()
    try:
        program = Program()
        for path in victim_paths:
            program.read_file(f"read carol's compiled kernel {path}", path, 64, secret=original[:64])
            program.list_dir(f"list carol's cache entry {path.parents[2]}", path.parents[2], secret=name.encode())
            program.open_probe(f"open carol's compiled kernel for writing {path}", path, O_WRONLY)
            program.replace_file(f"rename a look-alike over carol's kernel {path}", path, payload)
        attack(world, program, "another tenant's compile cache")
        assert victim_paths[0].read_bytes() == (payload if VULNERABLE else original), "carol's compiled kernel"
        # Once carol's worker is reaped (her session is over), her next worker loads the kernel from her cache.
        carol.gpu.close()
        wait_for(lambda: pid_state(carol.pid) in (None, "Z"), timeout=20, what="carol's idle worker to be reaped")
        carol = _open(broker, "carol", innocent, ("gpb_addr", name))
        out = computes(carol, carol.kernels[name])
        np.testing.assert_array_equal(out, np.full_like(x, 666.0) if VULNERABLE else x * 2 + 1)  # whose code ran
        assert_serves(world.broker, world.victim)
    finally:
        carol.gpu.close()
        # The entries are this run's own (a fresh kernel name); keep shared caches from growing run after run.
        for path in (*victim_paths, *evil_paths):
            if path.parents[1].name == name:
                shutil.rmtree(path.parents[1], ignore_errors=True)


def test_cannot_open_a_network_socket(world: World) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    broker_port = int(world.broker.tcp_target.rsplit(":", 1)[1])
    unix = Path(world.broker.target.removeprefix("unix:"))
    program = Program()
    program.connect(f"TCP connect to a listener on 127.0.0.1:{port}", AF_INET, sockaddr_in(port))
    program.connect(f"TCP connect to the broker's TLS port 127.0.0.1:{broker_port}", AF_INET, sockaddr_in(broker_port))
    for path in (unix, unix.with_name(unix.name + ".fast")):
        if path.exists():
            program.connect(f"connect to the broker's socket {path}", AF_UNIX, sockaddr_un(path))
    try:
        attack(world, program, "network sockets")
        # A completed TCP handshake waits in the listener's backlog already when connect() returns.
        try:
            listener.accept()[0].close()
            accepted = True
        except BlockingIOError:
            accepted = False
        assert accepted == VULNERABLE, "the test's listener " + ("got no" if VULNERABLE else "got a") + " connection"
    finally:
        listener.close()
    assert_serves(world.broker, world.victim)


def test_cannot_signal_the_front_or_another_worker(tmp_path: Path) -> None:
    """A broker of its own: unsandboxed, this attack stops and kills the front."""
    check_arch()
    with BrokerProcess(TENANTS[:2], backend="opencl", settings=_settings(tmp_path)) as broker, \
            contextlib.ExitStack() as sessions:
        assert broker.process is not None
        front = broker.process.pid
        attacker = _open(broker, "alice", ATTACK_SOURCE, ("gpb_attack", "gpb_addr"))
        sessions.callback(attacker.gpu.close)
        victim = _open(broker, "bob", VICTIM_SOURCE, ("gpb_addr", "gpb_scale"))
        sessions.callback(victim.gpu.close)
        buf, data, _ = plant(victim)
        pids = {"bob's worker": victim.pid, "the front": front}

        stop = Program()
        for who, pid in pids.items():  # every way to signal another process, each of which a filter might miss
            stop.kill(f"kill({pid}, SIGSTOP) {who}", pid, SIGSTOP)
            stop.tgkill(f"tgkill({pid}, {pid}, SIGSTOP) {who}", pid, SIGSTOP)
            stop.pidfd_signal(f"pidfd_send_signal(pidfd_open({pid}), SIGSTOP) {who}", pid, SIGSTOP)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # Unsandboxed, a stopped front cannot answer the attacker's own launch: run it aside, resume the front.
            pending = pool.submit(launch, attacker, stop)
            try:
                if VULNERABLE:
                    wait_for(lambda: all(pid_state(p) == "T" for p in pids.values()), timeout=TIMEOUT,
                             what="the attacker's SIGSTOPs to land")
                else:  # done, or a stop landed (then the launch may never answer)
                    wait_for(lambda: pending.done() or any(pid_state(p) == "T" for p in pids.values()),
                             timeout=TIMEOUT, what="the attacker's launch")
                stopped = [who for who, pid in pids.items() if pid_state(pid) == "T"]
            finally:
                for pid in pids.values():
                    if pid_state(pid) == "T":
                        os.kill(pid, signal.SIGCONT)
            check(pending.result(TIMEOUT), "SIGSTOP")
        assert bool(stopped) == VULNERABLE, f"stopped: {stopped}"

        kill = Program()
        for who, pid in pids.items():
            kill.kill(f"kill({pid}, SIGKILL) {who}", pid, SIGKILL)
            kill.tgkill(f"tgkill({pid}, {pid}, SIGKILL) {who}", pid, SIGKILL)
            kill.pidfd_signal(f"pidfd_send_signal(pidfd_open({pid}), SIGKILL) {who}", pid, SIGKILL)
        if VULNERABLE:
            # The first kill of each lands; what follows finds a dead process. The front is gone before it could
            # answer, most likely: its death is the proof.
            with contextlib.suppress(GpuBrokerError):
                attempts = run(attacker.gpu, attacker.kernels["gpb_attack"], kill)
                print("\nSIGKILL:\n" + "\n".join(f"  {a}" for a in attempts))
            wait_for(lambda: broker.process is not None and broker.process.poll() == -signal.SIGKILL, timeout=TIMEOUT,
                     what="the front to die of SIGKILL")
            return
        check(launch(attacker, kill), "SIGKILL")
        assert pid_state(victim.pid) not in (None, "Z"), "bob's worker died"
        assert contents(victim.gpu, buf) == data
        assert_serves(broker, victim)
