"""The worker sandbox, checked from outside against real brokers on PoCL: what each worker is and what it sees.

(The attacks from inside a kernel are in test_attacks.py; these check the layers those attacks run into.)
"""

from __future__ import annotations

import ast
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.broker.sandbox import WorkerSandbox
from gpubroker.client import AdminClient, CompileError, Unavailable, connect

from ..conftest import worker_pids
from ..helpers import proc_status, seccomp_filters

TENANTS = [TenantSpec("alice"), TenantSpec("bob"), TenantSpec("root-admin", admin=True)]
SECRET_ENV = "GPUBROKER_TEST_FRONT_SECRET"
NAMESPACES = ("user", "pid", "mnt", "net", "ipc", "uts", "cgroup")


@pytest.fixture(scope="module")
def sandboxed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    cache = tmp_path_factory.mktemp("caches")
    with BrokerProcess(TENANTS, backend="opencl", settings={"cache_dir": str(cache)},
                       env={SECRET_ENV: "front-only-secret"}) as proc:
        yield proc


def _start_worker(broker: BrokerProcess, tenant: str) -> int:
    """A live worker of ``tenant`` (one compile and launch ran in it); its pid."""
    with connect(broker.target, token=broker.tokens[tenant]) as gpu:
        buf = gpu.allocate_memory(64)
        kernel = gpu.compile_kernel(samples.source("opencl"), "scale_inplace")
        gpu.execute_kernel(kernel, 1, 16, [buf, np.float32(2), np.int32(16)])
        gpu.synchronize()
    (pid,) = worker_pids(broker, tenant)
    return pid


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if item)


def test_worker_runs_confined(sandboxed: BrokerProcess) -> None:
    pid = _start_worker(sandboxed, "alice")
    status = proc_status(pid)
    assert status["Seccomp"] == "2" and status["NoNewPrivs"] == "1"
    # Every thread (PoCL's pool too): the launcher's filter, its exec supervision's, and the one refusing new sockets
    # once the device is open.
    assert seccomp_filters(pid) == {3}
    for caps in ("CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb"):
        assert int(status[caps], 16) == 0, caps
    front = sandboxed.process.pid  # type: ignore[union-attr]
    for ns in NAMESPACES:
        assert os.readlink(f"/proc/{pid}/ns/{ns}") != os.readlink(f"/proc/{front}/ns/{ns}"), ns
    # Its /proc shows its own PID namespace: itself, as PID 1, and nothing of the front or other workers.
    root = Path(f"/proc/{pid}/root")
    assert {p.name for p in (root / "proc").iterdir() if p.name.isdigit()} == {"1"}
    # Sysctls and sysrq-trigger are read-only even to a worker whose uid is the host's root (a root broker's).
    for name in ("sys", "sysrq-trigger"):
        if Path("/proc", name).exists():  # (no sysrq-trigger on a kernel without CONFIG_MAGIC_SYSRQ)
            assert os.statvfs(root / "proc" / name).f_flag & os.ST_RDONLY, name
    # No network interface but loopback.
    assert [line.split(":")[0].strip() for line in (root / "proc/1/net/dev").read_text().splitlines()[2:]] == ["lo"]


def test_worker_sees_only_its_allowlist(sandboxed: BrokerProcess) -> None:
    alice, bob = _start_worker(sandboxed, "alice"), _start_worker(sandboxed, "bob")
    alice_env, bob_env = _environ(alice), _environ(bob)
    alice_cache, bob_cache = Path(alice_env["HOME"]), Path(bob_env["HOME"])
    root = Path(f"/proc/{alice}/root")
    assert (root / str(alice_cache).lstrip("/")).is_dir()
    hidden = [sandboxed.config_path, sandboxed.workdir, Path(sandboxed.target[len("unix:"):]), bob_cache,
              Path("/etc/passwd"), Path("/etc/shadow"), Path("/root/.ssh"), Path("/run")]
    for path in hidden:
        assert not (root / str(path).lstrip("/")).exists(), path
    # The system directories are there, read-only; its cache is writable.
    assert (root / "usr/lib").is_dir()
    assert os.statvfs(root / "usr").f_flag & os.ST_RDONLY
    assert not os.statvfs(root / str(alice_cache).lstrip("/")).f_flag & os.ST_RDONLY


def test_environment_is_scrubbed_and_caches_are_per_tenant(sandboxed: BrokerProcess) -> None:
    alice, bob = _start_worker(sandboxed, "alice"), _start_worker(sandboxed, "bob")
    alice_env, bob_env = _environ(alice), _environ(bob)
    for env in (alice_env, bob_env):
        assert SECRET_ENV not in env
        assert set(env) <= {"PATH", "LANG", "LC_ALL", "TZ", "PYTHONPATH", "LD_LIBRARY_PATH", "GPUBROKER_LOG_FORMAT",
                            "HOME", "XDG_CACHE_HOME", "POCL_CACHE_DIR", "CUPY_CACHE_DIR", "CUDA_CACHE_PATH",
                            "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_PATH", "CUDA_HOME",
                            "PYTHONNOUSERSITE", "GPUBROKER_WORKER_EXEC", "GPUBROKER_WORKER_SEAL",
                            "PYOPENCL_NO_CACHE", "USER", "LOGNAME",
                            # (forked by the zygote: its BLAS pools of one thread)
                            "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"} | {
                                k for k in env if k.startswith(("POCL_", "CUPY_", "OCL_ICD_"))}
        # pyopencl's caches are sqlite databases, which lock: the seal refuses record locks once the device is open.
        assert env.get("PYOPENCL_NO_CACHE") == "1"
        # getpass.getuser() needs no password-database entry for the worker's uid (PyTorch's caches call it)
        assert env.get("USER") == env.get("LOGNAME") == "gpubroker-worker"
    alice_cache, bob_cache = Path(alice_env["HOME"]), Path(bob_env["HOME"])
    # <cache_dir>/tenants/<name>/<key of its token>: each tenant's own, and a new tenant's under an old name new
    assert alice_cache != bob_cache and alice_cache.parent.parent == bob_cache.parent.parent
    assert alice_cache.parent.name == "alice" and alice_env["POCL_CACHE_DIR"].startswith(str(alice_cache))
    for cache in (alice_cache, bob_cache, alice_cache.parent, alice_cache.parent.parent):
        assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    # (The worker writes it into a tmpfs over its directory, saved back to the disk when it exits:
    # test_worker_resources.py.)
    seen = Path(f"/proc/{alice}/root") / str(alice_cache / "pocl").lstrip("/")
    assert any(seen.rglob("*")), "PoCL's kernel cache is not in the tenant's directory"


@pytest.mark.parametrize("target", ["config", "/etc/passwd"])
def test_include_of_a_host_file_reveals_nothing(sandboxed: BrokerProcess, target: str) -> None:
    path = sandboxed.config_path if target == "config" else Path(target)
    content = path.read_text()
    with connect(sandboxed.target, token=sandboxed.tokens["alice"]) as gpu, pytest.raises(CompileError) as info:
        gpu.compile_kernel(f'#include "{path}"\n__kernel void k(__global int* x) {{ x[0] = 1; }}\n', "k")
    log = info.value.log + info.value.message
    assert "not found" in log
    for line in content.splitlines():
        if len(line.strip()) > 6:  # every meaningful line of the file is absent from what the tenant sees
            assert line.strip() not in log


def test_status_shows_the_sandbox(sandboxed: BrokerProcess) -> None:
    with AdminClient(sandboxed.target, sandboxed.tokens["root-admin"]) as admin:
        assert admin.status().sandbox.startswith("namespaces+seccomp+")


def test_sandbox_off_works_and_warns(tmp_path: Path) -> None:
    with BrokerProcess(TENANTS[:1], backend="opencl", settings={"sandbox": False, "cache_dir": str(tmp_path)}) as b:
        pid = _start_worker(b, "alice")
        front = b.process.pid  # type: ignore[union-attr]
        assert os.readlink(f"/proc/{pid}/ns/pid") == os.readlink(f"/proc/{front}/ns/pid")
        assert "sandbox is OFF" in b.log_tail(20000)
        # Still a compile cache of its own (a shared one let a tenant replace another's compiled kernels).
        pocl = Path(_environ(pid)["POCL_CACHE_DIR"])
        assert pocl.name == "pocl" and pocl.parent.parent == tmp_path / "tenants" / "alice"


def test_broker_refuses_to_start_without_its_sandbox(tmp_path: Path) -> None:
    # A host without libseccomp's Python binding: the same failure as a missing libseccomp.so.2.
    (tmp_path / "pyseccomp.py").write_text("raise ImportError('libseccomp is not installed')\n")
    broker = BrokerProcess(TENANTS[:1], backend="opencl", env={"PYTHONPATH": str(tmp_path)}, start_timeout=60)
    with pytest.raises(Exception, match="cannot sandbox the workers") as info:
        broker.start()
    broker.stop()
    assert "libseccomp is not installed" in str(info.value)
    assert "--no-sandbox" in str(info.value) and "sandbox = false" in str(info.value)


# Run inside the sandbox by the test below: each refused call prints its errno name; the test checks the list.
_INSIDE = r"""
import ctypes, errno, os, socket, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
def err(call):
    try:
        result = call()
    except OSError as exc:
        return errno.errorcode[exc.errno]
    if isinstance(result, int) and result < 0:
        return errno.errorcode[ctypes.get_errno()]
    return "allowed"
results = {
    "inet": err(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)),
    "inet6": err(lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)),
    "netlink": err(lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW)),
    "unix": err(lambda: socket.socketpair()),
    "kill_other": err(lambda: os.kill(4242, 0)),
    "kill_self": err(lambda: os.kill(os.getpid(), 0)),
    "ptrace": err(lambda: libc.ptrace(0, 0, 0, 0)),
    "unshare": err(lambda: libc.unshare(0x10000000)),
    "mount": err(lambda: libc.mount(b"none", b"/tmp", b"tmpfs", 0, None)),
    "clone3": err(lambda: libc.syscall(435, 0, 0)),
    "personality": err(lambda: libc.personality(0x0040000)),
    "bpf": err(lambda: libc.syscall(321, 0, 0, 0)),
    "config": err(lambda: open(sys.argv[1]).read()),
    "passwd": err(lambda: open("/etc/passwd").read()),
    "sysctl": err(lambda: open("/proc/sys/kernel/hostname", "w").write("x")),
    "usr": err(lambda: open("/usr/gpubroker-test", "w")),
    "tmp": err(lambda: open("/tmp/scratch", "w").write("x")),
}
thread = threading.Thread(target=lambda: None); thread.start(); thread.join()
def fork():
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    return os.waitpid(pid, 0)[1]
results["fork"] = err(fork)
# The one way to start a process on OpenCL: posix_spawn's clone(CLONE_VM | CLONE_VFORK), for PoCL's linker.
results["posix_spawn"] = err(lambda: os.waitpid(os.posix_spawn("/bin/true", ["/bin/true"], {}), 0)[1])
results["memfd"] = err(lambda: os.memfd_create("x"))
results["shmget"] = err(lambda: libc.shmget(0, 1 << 20, 0o1600))
# Nodes: regular files only (a FIFO could keep a compile waiting on an #include of it); the file type in the high
# bits of mknodat's mode register too (the kernel reads only the low 16).
results["fifo"] = err(lambda: os.mkfifo("/tmp/fifo"))
results["socket_node"] = err(lambda: os.mknod("/tmp/sock", 0o140600))
results["whiteout"] = err(lambda: os.mknod("/tmp/whiteout", 0o020600, 0))
results["fifo_high_bits"] = err(lambda: libc.syscall(259, -100, b"/tmp/fifo2", ctypes.c_ulong((1 << 40) | 0o010600), 0))
results["regular_node"] = err(lambda: os.mknod("/tmp/regular", 0o100600))
# What a worker does once its device is open (CUDA's initialization makes a Unix socket): no new socket at all.
# Descriptors come in on the front's fd channel alone (issue 21: a client's memfd received off a link and filled):
# recvmsg on any other socket is refused, and the channel's number cannot be made to name another socket.
from gpubroker.broker.sandbox import seal_after_device_open
channel, front = socket.socketpair()
link, client = socket.socketpair()
for sender in (front, client):
    socket.send_fds(sender, [b"x"], [os.open("/dev/null", os.O_RDONLY)])
seal_after_device_open(channel.fileno())
results["unix_once_open"] = err(lambda: socket.socketpair())
results["unix_socket_once_open"] = err(lambda: socket.socket(socket.AF_UNIX))
results["recvmsg_link"] = err(lambda: socket.recv_fds(link, 1, 1))
results["recvmsg_high_bits"] = err(lambda: libc.syscall(47, ctypes.c_ulong((1 << 32) | channel.fileno()), None, 0))
results["passrights_on"] = err(lambda: link.setsockopt(socket.SOL_SOCKET, 83, 1))
results["dup2_onto_channel"] = err(lambda: os.dup2(link.fileno(), channel.fileno()))
results["dup3_onto_channel"] = err(lambda: os.dup2(link.fileno(), channel.fileno(), inheritable=False))
results["close_channel"] = err(lambda: libc.close(channel.fileno()))
results["cloexec_channel"] = err(lambda: os.set_inheritable(channel.fileno(), False))
results["close_range"] = err(lambda: libc.syscall(436, 0, 0xFFFFFFFF, 0))
results["recvmsg_channel"] = err(lambda: socket.recv_fds(channel, 1, 1))
print(results)
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="raw syscall numbers of x86-64")
def test_sandboxed_process_is_refused_what_it_must_not_do(tmp_path: Path) -> None:
    secret = tmp_path / "gpubroker.toml"
    secret.write_text("token_hash = 'x'\n")
    sandbox = WorkerSandbox(enabled=True, backend="opencl", cache_dir=str(tmp_path / "cache"), use_cgroups=False)
    cache = sandbox.tenant_cache("alice")
    uid = sandbox.uids.take("alice") if sandbox.uids is not None else None  # (a root broker's worker: its own uid)
    argv = sandbox.launcher_argv(sandbox.spec(cache, [], None, uid=uid), [sys.executable, "-c", _INSIDE, str(secret)])
    proc = subprocess.run(argv, env=sandbox.environment(cache), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    results = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert results == {
        "inet": "EPERM", "inet6": "EPERM", "netlink": "EPERM", "unix": "allowed", "kill_other": "EPERM",
        "kill_self": "allowed", "ptrace": "EPERM", "unshare": "EPERM", "mount": "EPERM", "clone3": "ENOSYS",
        "personality": "EPERM", "bpf": "EPERM", "config": "ENOENT", "passwd": "ENOENT", "sysctl": "EROFS",
        "usr": "EROFS", "tmp": "allowed", "fork": "EPERM", "memfd": "EPERM", "shmget": "EPERM",
        "posix_spawn": "allowed", "unix_once_open": "EPERM", "unix_socket_once_open": "EPERM", "fifo": "EPERM",
        "socket_node": "EPERM", "whiteout": "EPERM", "fifo_high_bits": "EPERM", "regular_node": "allowed",
        "recvmsg_link": "EPERM", "recvmsg_high_bits": "EPERM", "passrights_on": "EPERM", "dup2_onto_channel": "EPERM",
        "dup3_onto_channel": "EPERM", "close_channel": "EPERM", "cloexec_channel": "EPERM", "close_range": "ENOSYS",
        "recvmsg_channel": "allowed"}


def test_devices_command_shows_the_sandbox() -> None:
    proc = subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", "devices", "--backend", "opencl"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "sandbox: namespaces+seccomp" in proc.stdout.splitlines()[0]


@pytest.mark.cuda
def test_cuda_worker_is_confined_and_nvrtc_cannot_include_host_files(tmp_path: Path) -> None:
    """On the GPU: the sandboxed CUDA worker runs kernels, and NVRTC (in the worker) cannot read host files."""
    with BrokerProcess(TENANTS[:1], backend="cuda", settings={"cache_dir": str(tmp_path)}) as broker:
        with connect(broker.target, token=broker.tokens["alice"]) as gpu:
            buf = gpu.allocate_memory(64)
            gpu.copy_h2d(np.ones(16, dtype=np.float32), buf)
            kernel = gpu.compile_kernel(samples.source("cuda"), "scale_inplace")
            gpu.execute_kernel(kernel, 1, 16, [buf, np.float32(2), np.int32(16)])
            gpu.synchronize()
            out = np.empty(16, dtype=np.float32)
            gpu.copy_d2h(buf, out)
            assert (out == 3).all()  # scale_inplace: x = x * factor + 1
            for path in (broker.config_path, Path("/etc/passwd")):
                content = path.read_text()
                with pytest.raises(CompileError) as info:
                    gpu.compile_kernel(f'#include "{path}"\nextern "C" __global__ void k(int* x) {{ x[0] = 1; }}\n',
                                       "k")
                log = info.value.log + info.value.message
                for line in content.splitlines():
                    if len(line.strip()) > 6:
                        assert line.strip() not in log, path
        (pid,) = worker_pids(broker, "alice")
        status = proc_status(pid)
        assert status["Seccomp"] == "2" and status["NoNewPrivs"] == "1" and int(status["CapEff"], 16) == 0
        # Every thread (CUDA's own too): the launcher's filter and the one refusing new sockets once the device is
        # open (no exec supervision: CUDA spawns nothing).
        assert seccomp_filters(pid) == {2}
        assert os.readlink(f"/proc/{pid}/ns/pid") != os.readlink(f"/proc/{broker.process.pid}/ns/pid")  # type: ignore[union-attr]


def test_a_cache_dir_the_broker_cannot_use_stops_it_at_start_by_name(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    broker = BrokerProcess(TENANTS[:1], backend="opencl", settings={"cache_dir": str(blocker / "caches")})
    with pytest.raises(Unavailable, match=r"\[broker\] cache_dir: cannot use"):
        broker.start()
    broker.stop()
