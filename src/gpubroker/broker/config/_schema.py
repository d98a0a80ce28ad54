"""The config's schema: the size and octal forms, and one msgspec Struct per kind of table.

``TenantConfig`` ([tenants.NAME]), ``TlsConfig`` ([tls] and [tls.identities]), ``BrokerSettings`` ([broker]) and
``BrokerConfig`` (all three and the file's path). Every field carries its type, its range and a description.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from gpubroker.wire.errors import AlreadyExists, InvalidArgument, NotFound

__all__ = [
    "DEFAULT_SOCKET",
    "OCTAL",
    "ONE_OR_MORE",
    "SIZE",
    "BrokerConfig",
    "BrokerSettings",
    "TenantConfig",
    "TlsConfig",
    "format_size",
    "parse_size",
    "parse_uid_range",
]

DEFAULT_SOCKET = "unix:/run/gpubroker/gpubroker.sock"
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}
UID_MAX = 2**32 - 2  # (2**32 - 1 is (uid_t) -1: "no change" to setresuid and chown)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class _Form:
    """A marker in a field's ``Annotated`` metadata: the TOML form the value may take besides its type."""

    def __init__(self, what: str) -> None:
        self.what = what

    def __repr__(self) -> str:
        return f"<{self.what}>"


# Bytes, written as an int or a string with a unit ("8GiB", "512MiB", "1000").
SIZE = _Form("size")
# A Unix permission mode, written as an octal string ("660") or an int (0o660).
OCTAL = _Form("octal")
# A list of strings that may also be written as one string.
ONE_OR_MORE = _Form("one or more")


def parse_size(value: str | int) -> int:
    """'8GiB', '512MiB', '1000' or an int, as bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value) if isinstance(value, str) else None
    if not match or match.group(2).lower() not in _UNITS:
        raise InvalidArgument(f"not a size: {value!r} (examples: 8GiB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(n: int) -> str:
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def parse_uid_range(text: str) -> tuple[int, int] | None:
    """worker_uids: 'FIRST-LAST' (decimal or 0x hex) as (first, last), or None for '0' (as root); ValueError for
    anything else."""
    if text.strip() == "0":
        return None
    first, sep, last = text.partition("-")
    try:
        if not sep:
            raise ValueError
        low, high = int(first.strip(), 0), int(last.strip(), 0)
    except ValueError:
        raise ValueError(f"expected FIRST-LAST (e.g. 2147418112-2147483646) or 0, got {text!r}") from None
    if not 1 <= low <= high <= UID_MAX:
        raise ValueError(f"expected 1 <= FIRST <= LAST <= {UID_MAX}, got {text!r}")
    return low, high


# -- the schema ------------------------------------------------------------------------------------------------
# Every field: Annotated[type, Meta(range, description=...), form marker] = default. The defaults are the
# broker's; the descriptions are the config reference's text.


class TenantConfig(msgspec.Struct, forbid_unknown_fields=True):
    """A tenant: a ``[tenants.NAME]`` table. `gpubroker tenant add` writes it; the token itself is never stored."""

    name: Annotated[str, Meta(pattern=_NAME.pattern, description=(
        "The tenant's name: the NAME of its [tenants.NAME] table (1-64 of A-Z a-z 0-9 _ . -)."))]
    token_id: Annotated[str, Meta(description=(
        "The public part of the tenant's bearer token (gpb_<token_id>_<secret>), which finds its hash."))]
    token_hash: Annotated[str, Meta(description=(
        "A salted hash of the token's secret; `gpubroker tenant add` and `rotate-token` write it."))]
    memory_quota: Annotated[int, Meta(ge=1, description=(
        "Device memory the tenant's sessions may hold on each device, unless device_memory gives that device "
        "a quota of its own.")), SIZE] = msgspec.field(default=8 * 1024**3, name="memory")
    weight: Annotated[int, Meta(ge=1, le=1_000_000, description=(
        "The tenant's share of each device under fair scheduling, relative to the other tenants' weights."))] = 1
    admin: Annotated[bool, Meta(description=(
        "May call the Admin service: list and end sessions, reload, drain, usage and status."))] = False
    device_memory: Annotated[dict[Annotated[int, Meta(ge=0)], Annotated[int, Meta(ge=1)]], Meta(description=(
        "Quotas of their own on some devices: broker device index = size, e.g. { 1 = \"64GiB\" }.")),
        SIZE] = msgspec.field(default_factory=dict)
    shared_memory_quota: Annotated[Annotated[int, Meta(ge=0)] | None, Meta(description=(
        "Host memory all of the tenant's sessions together may share with their workers as segments registered "
        "on <socket>.fast (host arrays and staging buffers, on every device), links' rings and CopyPeer's host "
        "staging (a quarter of it, 128 MiB at most); more is refused with "
        "RESOURCE_EXHAUSTED. Absent: equal to the tenant's memory (its device memory quota), so a tenant's "
        "shared host memory grows with its quota. The broker's max_shared_bytes_per_tenant caps it too.")),
        SIZE] = msgspec.field(default=None, name="shared_memory")
    certificates_since: Annotated[float, Meta(ge=0, description=(
        "With mTLS: a client certificate issued before this (Unix seconds; its notBefore earlier by more than an "
        "hour, which allows minting a tenant's certificate just before adding it) authenticates nobody as this "
        "tenant, so a tenant added again under a freed name gets none of the certificates issued to its "
        "predecessor. `gpubroker tenant add` writes the time it adds the tenant; 0: every certificate naming the "
        "tenant."))] = 0.0

    def quota_on(self, device: int) -> int:
        """The memory quota on one of the broker's devices."""
        return self.device_memory.get(device, self.memory_quota)

    def shared_quota(self) -> tuple[int, str]:
        """The host memory the tenant may map as shared-memory segments, and the key that sets it."""
        if self.shared_memory_quota is not None:
            return self.shared_memory_quota, "shared_memory"
        return self.memory_quota, "shared_memory, which defaults to memory"


class TlsConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """TLS for TCP listeners (``[tls]``). With ``client_ca_file`` set, clients present certificates signed by it."""

    cert_file: Annotated[str, Meta(description=(
        "The broker's certificate chain (PEM); a relative path is relative to the config file."))] = ""
    key_file: Annotated[str, Meta(description="The broker's private key (PEM, mode 0600).")] = ""
    client_ca_file: Annotated[str, Meta(description=(
        "The CA that client certificates must chain to (with require_client_cert)."))] = ""
    require_client_cert: Annotated[bool, Meta(description=(
        "mTLS: the handshake refuses TCP clients without a valid certificate from client_ca_file; false asks "
        "for no certificate, and TCP clients authenticate by token."))] = False
    allow_tokens: Annotated[bool, Meta(description=(
        "With client certificates, whether bearer tokens are still accepted on TCP; false: only a certificate "
        "that names a tenant authenticates."))] = True
    identities: Annotated[dict[str, Annotated[str, Meta(pattern=_NAME.pattern)]], Meta(description=(
        "[tls.identities]: a client certificate's SAN URI or CN = the tenant it authenticates as; an unmapped "
        "CN names the tenant itself."))] = msgspec.field(default_factory=dict)


class BrokerSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The ``[broker]`` table: everything `gpubroker serve` reads besides TLS and tenants; defaults suit one host."""

    listen: Annotated[list[str], Meta(min_length=1, description=(
        "Where to serve: unix:PATH and/or HOST:PORT (one string or a list). TCP is TLS when [tls] is set; "
        "without it only loopback TCP is allowed (or insecure = true).")),
        ONE_OR_MORE] = msgspec.field(default_factory=lambda: [DEFAULT_SOCKET])
    backend: Annotated[Literal["auto", "cuda", "opencl"], Meta(description=(
        "auto: CUDA when CuPy sees a GPU, else OpenCL (PoCL's CPU device when nothing else is there)."))] = "auto"
    devices: Annotated[list[Annotated[int, Meta(ge=0)]] | None, Meta(description=(
        "The backend's devices to serve, as distinct indices, served as devices 0, 1, ... in this order; "
        "absent: every device the backend finds."))] = None
    chunk_bytes: Annotated[int, Meta(ge=1, description=(
        "The largest piece of a host<->device copy streamed over gRPC; must leave 4 KiB under "
        "max_message_bytes.")), SIZE] = 1024 * 1024
    max_message_bytes: Annotated[int, Meta(ge=8192, description=(
        "The largest gRPC message; larger ones get RESOURCE_EXHAUSTED.")), SIZE] = 4 * 1024 * 1024
    lease_seconds: Annotated[float, Meta(gt=0, description=(
        "A session with no authenticated call or heartbeat for this long is ended and its memory freed."))] = 30.0
    worker_idle_seconds: Annotated[float, Meta(ge=0, description=(
        "A tenant's worker process with no session for this long is stopped."))] = 60.0
    worker_start_timeout: Annotated[float, Meta(gt=0, description=(
        "How long a worker may take to start before the session that asked for it fails."))] = 60.0
    worker_send_buffer_bytes: Annotated[int, Meta(ge=1, description=(
        "The bytes of requests the front holds for one worker that has not read them yet (its kernel or compile "
        "keeps it busy): a request past it gets RESOURCE_EXHAUSTED with a retry hint (one request alone always "
        "goes, whatever its size). Requests wait for room before they are written, so one whose caller gives "
        "up leaves nothing behind. The default is max_read_ahead_bytes_per_tenant's: a tenant's honest "
        "concurrent copies fit.")), SIZE] = 64 * 1024 * 1024
    worker_write_stall_seconds: Annotated[float, Meta(gt=0, description=(
        "A worker that reads none of the front's requests for this long while some wait to be written (more "
        "than the socket holds: a few hundred KiB) is killed, its tenant's failure (RESOURCE_EXHAUSTED). "
        "Keep it above the longest kernel or compile a tenant runs while it also sends large requests."))] = 300.0
    socket_mode: Annotated[int, Meta(ge=0, le=0o777, description=(
        "The Unix sockets' permission mode, as an octal string (\"660\") or an int (0o660).")), OCTAL] = 0o660
    socket_group: Annotated[str, Meta(description=(
        "The group owning the Unix sockets (its members may connect); empty keeps the broker's."))] = ""
    insecure: Annotated[bool, Meta(description=(
        "Allow plaintext TCP on non-loopback addresses: tokens travel in the clear (warned at every "
        "start)."))] = False
    vsock_port: Annotated[int, Meta(ge=0, le=0xFFFFFFFF, description=(
        "Also accept VMs (vhost-vsock) on this AF_VSOCK port, relayed to the first unix listener's gRPC; each "
        "guest (its CID) is a peer of the gRPC per-peer caps and call rate; 0: off."))] = 0
    link_listen: Annotated[str, Meta(description=(
        "Serve the framed command link (client <-> worker, authenticated by the front) over TCP on HOST:PORT, "
        "with the TCP listeners' TLS / mTLS ([tls]); without [tls] only on loopback (or insecure = true); empty: "
        "off."))] = ""
    link_tls_processes: Annotated[int, Meta(ge=-1, le=64, description=(
        "Processes that relay link_listen's TLS links (the handshake, then decrypting and encrypting every byte): "
        "Python's ssl decrypts a 16 KiB record a call, one turn on its process's interpreter, so relays in one "
        "process go at one core's pace together; -1: one per two cores, at most 4; 0: none (the front's threads "
        "relay them)."))] = -1
    link_vsock_port: Annotated[int, Meta(ge=0, le=0xFFFFFFFF, description=(
        "Serve the framed command link to VM guests on this AF_VSOCK port (handed straight to the session's "
        "worker after the front authenticates the hello); 0: off."))] = 0
    max_links_per_tenant: Annotated[int, Meta(ge=1, description=(
        "Framed links one tenant may have being handed to its workers, served by them (the front keeps a "
        "descriptor of each, to end it with the worker) or relayed by the front (a TCP link: a thread and a few "
        "descriptors each) across all its sessions; more are refused with RESOURCE_EXHAUSTED. Each session has at "
        "most 8 whatever this is."))] = 64
    link_handoff_timeout_seconds: Annotated[float, Meta(gt=0, description=(
        "How long a session's worker may take to accept a new link (it is busy in a kernel or compile "
        "meanwhile); past it the link is refused with UNAVAILABLE and the client may retry."))] = 30.0
    drain_grace_seconds: Annotated[float, Meta(ge=0, description=(
        "Draining (SIGTERM, or Admin Drain with a grace): how long running sessions may go on before they are "
        "ended."))] = 30.0
    device_failure_threshold: Annotated[int, Meta(ge=0, description=(
        "A device whose workers fail this often within the window, for causes no tenant made (a worker that "
        "fails to start, a critical Xid), takes no new sessions (health NOT_SERVING) until a window passes "
        "with no further failure; 0: never."))] = 3
    device_failure_window_seconds: Annotated[float, Meta(ge=0.001, description=(
        "The window of device_failure_threshold."))] = 60.0
    nvml_xid_events: Annotated[bool, Meta(description=(
        "On CUDA with pynvml importable: a critical Xid other than an application error takes the device out "
        "of service."))] = True
    nvml_memory_watch: Annotated[bool, Meta(description=(
        "On CUDA with pynvml importable (nvidia-ml-py, in the cuda extra): the front reads every worker's device "
        "memory from NVML every 0.1 s and kills a worker holding more than its tenant's quota on that device plus "
        "device_memory_headroom (RESOURCE_EXHAUSTED, the tenant's failure). This bound holds whatever runs in the "
        "worker; without it, device memory is held to the quota only by the worker's own accounting."))] = True
    device_memory_headroom: Annotated[int, Meta(ge=0, description=(
        "Device memory a CUDA worker may hold beyond its tenant's quota before the NVML watch (nvml_memory_watch) "
        "kills it: what no quota counts, the CUDA context (about 525 MiB on an H100 or H200), the loaded modules' "
        "code and globals, cuBLAS, cuDNN and cuFFT workspaces and plans, the temporaries of library operations "
        "(run_library: an FFT's or a sort's, transient), and the allocators' rounding (PyTorch's caching "
        "allocator may hold 96 MiB past the quota). Raise it for tenants that run large library operations "
        "while holding most of their quota. On a device a worker does not serve, this is all it may hold. A "
        "quota lowered by a reload applies to new allocations: the bound uses the highest quota the worker was "
        "given.")), SIZE] = 1024**3
    max_sessions_per_tenant: Annotated[int, Meta(ge=1, description=(
        "Open sessions per tenant across all devices; more get RESOURCE_EXHAUSTED."))] = 16
    max_concurrent_rpcs_per_session: Annotated[int, Meta(ge=1, description=(
        "Calls one session may have in flight at once; more get RESOURCE_EXHAUSTED."))] = 32
    max_handles_per_session: Annotated[int, Meta(ge=1, description=(
        "Buffers, modules, kernels, streams and segments one session may hold at once."))] = 4096
    max_module_bytes: Annotated[int, Meta(ge=1, description=(
        "The largest kernel source or module image.")), SIZE] = 2 * 1024 * 1024
    compile_timeout_seconds: Annotated[float, Meta(gt=0, description=(
        "A compile that runs longer gets DEADLINE_EXCEEDED and the tenant's worker is restarted."))] = 60.0
    max_streams_per_session: Annotated[int, Meta(ge=1, description="Streams one session may hold at once.")] = 64
    max_inflight_per_tenant: Annotated[int, Meta(ge=1, description=(
        "gRPC calls in flight across all of a tenant's connections and sessions; more get RESOURCE_EXHAUSTED. A "
        "call counts from its authentication, before its request message is read, to its end: what a tenant's "
        "requests still on their way in hold of the broker's memory is at most this times max_message_bytes."))] = 256
    max_read_ahead_bytes_per_tenant: Annotated[int, Meta(ge=1, description=(
        "The bytes (as sent) of a tenant's gRPC Commands batches that the front has read and not yet run, across "
        "all its streams: a stream reads on only while the tenant is under this (one batch larger than it runs "
        "alone). The front holds a few times this in memory as it decodes and queues them.")), SIZE] = 64 * 1024**2
    max_unsent_reply_bytes_per_tenant: Annotated[int, Meta(ge=1, description=(
        "The bytes of a tenant's gRPC replies that the front has produced and gRPC has not yet sent (Commands "
        "acks, the Read results in them, and CopyDeviceToHost chunks its client has not taken), across all its "
        "calls: a batch or chunk runs only while the tenant is under this counting what it will return (one "
        "larger than it runs alone), so a client that does not read its replies stops its calls, not the front's "
        "memory. The front holds a few times this in memory (the worker's reply, the message, gRPC's copy).")),
        SIZE] = 64 * 1024**2
    max_shared_bytes_per_session: Annotated[int, Meta(ge=0, description=(
        "Host memory one session may map as same-host shared-memory segments registered on <socket>.fast "
        "(its host arrays and its staging buffer).")), SIZE] = 4 * 1024**3
    max_shared_bytes_per_tenant: Annotated[int, Meta(ge=0, description=(
        "The most host memory any tenant's sessions together may map as shared-memory segments, whatever the "
        "tenant's own shared_memory (which defaults to its memory quota); the limit in effect for each tenant is "
        "shown in Usage and the metrics.")), SIZE] = 16 * 1024**3
    max_shm_connections_per_tenant: Annotated[int, Meta(ge=1, description=(
        "Authenticated shared-memory connections (segment registration on <socket>.fast) one tenant may hold "
        "open (a client holds one per session); more are refused with RESOURCE_EXHAUSTED, so one tenant's idle "
        "connections cannot use up the listener for the others."))] = 64
    sandbox: Annotated[bool, Meta(description=(
        "Run every worker in a sandbox (namespaces, an allowlisted filesystem, seccomp, resource limits); "
        "false is warned at every start, and the broker refuses to start when it cannot sandbox unless this is "
        "false."))] = True
    worker_zygote: Annotated[bool, Meta(description=(
        "Start sandboxed workers as forks of one process (the zygote, started with the broker) that has loaded a "
        "worker's code once, instead of a new interpreter each that imports it again: a tenant's first session "
        "is that much faster, the sandbox the same. The workers then share the zygote's address-space layout "
        "(none can reach another's memory). false: each worker is a fresh exec, as is every worker while the "
        "zygote loads (a start meanwhile waits for it), should it fail, or after a worker it forked fails to "
        "start where an exec'd one starts (the log says which)."))] = True
    cache_dir: Annotated[str, Meta(description=(
        "Where the per-tenant compile caches live, one private subdirectory each (tenants/NAME/KEY, the key "
        "derived from the tenant's token: deleted when the tenant is removed or its token rotated, never found by "
        "a later tenant of the same name); empty: a directory of the broker's own under $CACHE_DIRECTORY, "
        "$STATE_DIRECTORY, $XDG_CACHE_HOME or ~/.cache."))] = ""
    worker_memory_max: Annotated[int, Meta(ge=0, description=(
        "Memory one worker may use, its /tmp, /dev/shm and compile cache included: cgroup v2 memory.max where "
        "the broker may create cgroups, else RLIMIT_DATA (private writable memory, both backends) and on OpenCL "
        "RLIMIT_AS, each less the tmpfs sizes and on OpenCL less the 128 MiB of the one linker PoCL may run at a "
        "time (held to that much by the sandbox). 0 (the default): automatic, per tenant and device: the tenant's "
        "memory quota on that device (on OpenCL's CPU devices, buffers are host memory) plus its shared_memory "
        "(shared-memory segments the worker maps; not counted in RLIMIT_DATA) plus the runtime's own (4 GiB on "
        "CUDA, enough for CuPy and PyTorch; on OpenCL 512 MiB and 32 MiB per CPU and the linker's 128 MiB, and "
        "RLIMIT_AS allows another "
        "512 MiB and 96 MiB per CPU of address space that PoCL reserves) plus cache_max_bytes and "
        "worker_tmp_max_bytes, and at least twice those two; a worker keeps the limit it started with until it "
        "is restarted. A value here applies to every worker instead.")), SIZE] = 0
    cache_max_bytes: Annotated[int, Meta(ge=1 << 20, description=(
        "The most one tenant's compile cache may hold. A sandboxed worker writes its cache into a tmpfs of this "
        "size (counted as its memory), seeded with the newest half of the cache on disk, and the cache on disk "
        "becomes what it held when it exited, within this bound (the oldest kernels are compiled again). No "
        "file a worker writes may be larger than this or worker_tmp_max_bytes (RLIMIT_FSIZE).")), SIZE] = 256 << 20
    worker_tmp_max_bytes: Annotated[int, Meta(ge=1 << 20, description=(
        "What a sandboxed worker's /tmp and /dev/shm may hold together (one tmpfs, counted as its memory). "
        "This and cache_max_bytes may take at most half of worker_memory_max (the automatic value leaves them "
        "that room).")), SIZE] = 64 << 20
    worker_pids_max: Annotated[int, Meta(ge=0, description=(
        "Processes and threads one worker may have (cgroup v2 pids.max, else an rlimit); 0: no limit."))] = 512
    worker_uids: Annotated[str, Meta(description=(
        "With the broker running as root: the host uids its sandboxed workers run as, FIRST-LAST (decimal or 0x "
        "hex): each worker gets one of its own (its gid the same number) for as long as any process of it lives, "
        "because the kernel counts some things per host uid rather than per namespace (pipe buffers, descriptors "
        "in flight on Unix sockets, RLIMIT_NPROC before Linux 5.14), so workers sharing one could take them from "
        "each other. A worker that cannot get one (every uid in use) is refused with RESOURCE_EXHAUSTED, charged "
        "to neither its tenant nor the device: keep the range larger than tenants x devices. The default, "
        "0x7FFF0000-0x7FFFFFFE, is a range no distribution, systemd (its container ranges end at 0x6FFFFFFF, its "
        "foreign range is 0x7FFE0000-0x7FFEFFFF) or shadow's subordinate ids allocate, below 2^31 where some "
        "programs mishandle uids; two root brokers on one host need ranges of their own. The workers must be able "
        "to read the Python install, the gpubroker packages and the device libraries, and open the device nodes, "
        "as any such user (world-readable and /dev/nvidia* mode 0666 as usual). 0: run them as root (the kernel "
        "never holds root to RLIMIT_NPROC: worker_pids_max then holds only with a pids cgroup). Ignored when the "
        "broker is not root (its workers run as its own user). Replaces worker_uid, one uid that every worker "
        "shared."))] = "2147418112-2147483646"
    worker_cpu_weight: Annotated[int, Meta(ge=1, le=10000, description=(
        "One worker's CPU weight against the others' (cgroup v2 cpu.weight, 1-10000)."))] = 100
    max_kernel_seconds: Annotated[float, Meta(ge=0, description=(
        "A tenant whose device work holds the device longer than this while another tenant waits has its "
        "worker killed; its calls fail with DEADLINE_EXCEEDED."))] = 10.0
    lone_kernel_seconds: Annotated[float, Meta(ge=0, description=(
        "The same limit for a tenant that nobody waits for (a runaway kernel is stopped even on an idle broker; a "
        "client can also cancel() its session's work); 0: a lone tenant may run kernels of any "
        "length."))] = 600.0
    max_kernel_slowdown: Annotated[float, Meta(ge=1, description=(
        "On a CPU device (PoCL: the device is the host's CPUs), how many times the host's other load may stretch "
        "a hold past the device time it is timed and charged by: a hold slowed by others counts what its own "
        "threads used and the compute units they left idle, but never less than its wall time divided by this. "
        "1: wall time, as on a GPU; higher: a kernel slowed by a heavier load still finishes, but a kernel that "
        "sleeps beside a thread that spins may hold the device that many times max_kernel_seconds while the host "
        "is saturated. Unused on a GPU (a hold's wall time is its device time)."))] = 2.0
    max_cpu_seconds_outside_turns: Annotated[float, Meta(ge=0, description=(
        "Host CPU-seconds a worker may use outside its tenant's device turns within "
        "cpu_outside_turns_window_seconds: threads or processes a kernel left running, beyond the CPU of the "
        "thread that serves a request (a compile; one CPU at most) while one is in flight. Past it the worker is "
        "killed (RESOURCE_EXHAUSTED, its tenant's failure). Such CPU is charged to the tenant's fair share "
        "either way. 0: no limit."))] = 10.0
    cpu_outside_turns_window_seconds: Annotated[float, Meta(gt=0, description=(
        "The window of max_cpu_seconds_outside_turns."))] = 60.0
    tenant_crash_budget: Annotated[int, Meta(ge=0, description=(
        "A tenant whose workers die this often within the window (its kernels, its compiles) gets UNAVAILABLE "
        "with a retry hint for new sessions until a window passes; never counted against device health; "
        "0: no budget."))] = 5
    tenant_crash_window_seconds: Annotated[float, Meta(gt=0, description=(
        "The window of tenant_crash_budget."))] = 60.0
    hello_max_bytes: Annotated[int, Meta(ge=1, description=(
        "The largest hello a peer may send before it authenticates on the raw listeners (<socket>.fast, "
        "link_listen, link_vsock_port).")), SIZE] = 64 * 1024
    hello_timeout_seconds: Annotated[float, Meta(gt=0, description=(
        "How long a peer on a raw listener may take to send its hello."))] = 5.0
    max_unauthenticated_connections: Annotated[int, Meta(ge=1, description=(
        "Unauthenticated connections the raw listeners keep open at once, per kind of listener (the Unix "
        "<socket>.fast sockets, link_listen, link_vsock_port: each its own count, so that peers of one never take "
        "another's places); more are closed."))] = 256
    max_unauthenticated_per_uid: Annotated[int, Meta(ge=1, description=(
        "The same, per peer across the raw listeners: a uid on Unix sockets (SO_PEERCRED) and on TCP from this host "
        "(the uid owning the client's socket: every local user has address 127.0.0.1), a /24 (IPv4) or /64 (IPv6) "
        "network on other TCP, a CID on vsock."))] = 64
    peer_network_ipv4: Annotated[int, Meta(ge=8, le=32, description=(
        "How remote IPv4 peers (TCP from another host) are grouped into one peer for every per-peer cap and rate: "
        "by their network of this prefix length. 24 (the default) counts a /24 as one peer, since one host may "
        "hold many addresses; where many clients each have an address in one /24 (pods of one Kubernetes node "
        "behind no NAT), 32 gives each address caps of its own, and an attacker holding many addresses as many "
        "peers. Local peers are counted by their uid, VM guests by their CID, whatever this says."))] = 24
    peer_network_ipv6: Annotated[int, Meta(ge=32, le=128, description=(
        "The same for remote IPv6 peers: 64 (the default) counts a /64 as one peer, since a host commonly holds "
        "a /64 of its own; 128 counts each address."))] = 64
    max_grpc_connections: Annotated[int, Meta(ge=1, description=(
        "gRPC connections the broker keeps open at once, authenticated or not, over all its listen addresses; "
        "more are refused as they are accepted. Each takes three of the broker's descriptors (the client's socket, "
        "and the front's relay to gRPC's private socket), and together they never take more than half the "
        "broker's descriptor limit (RLIMIT_NOFILE): the rest stay for workers, links and shared memory, so a flood "
        "of connections cannot starve a tenant's new session of descriptors."))] = 512
    max_grpc_connections_per_peer: Annotated[int, Meta(ge=1, description=(
        "gRPC connections one peer may hold at once, authenticated or not: a uid on a Unix socket (SO_PEERCRED) "
        "and on TCP from this host (the uid owning the client's socket: every local user has address 127.0.0.1), "
        "a /24 (IPv4) or /64 (IPv6) network on other TCP. More are refused as they are accepted, so a flood from "
        "one peer, however fast it reconnects, leaves the rest of max_grpc_connections to everyone else."))] = 64
    max_grpc_connections_per_tenant: Annotated[int, Meta(ge=1, description=(
        "gRPC connections one tenant may hold authenticated at once, whatever peers they come from: a connection "
        "counts against the tenant of its first authenticated call, and a call that would take its tenant past "
        "this is refused (RESOURCE_EXHAUSTED), its connection left unauthenticated (closed after "
        "grpc_unauthenticated_seconds, and evictable at max_grpc_connections). Authenticated connections are never "
        "evicted, so without it a tenant whose clients are several peers (uids of a container, /64s of an IPv6 "
        "prefix) could hold all of max_grpc_connections and lock the other tenants out."))] = 64
    grpc_unauthenticated_seconds: Annotated[float, Meta(gt=0, description=(
        "A gRPC connection none of whose calls has authenticated (with a tenant's or an admin's credential) this "
        "long after it was accepted is closed, whatever calls it made: calls refused for a wrong token and "
        "token-free health checks keep gRPC's idle close (grpc_idle_seconds) away, not this. And at "
        "max_grpc_connections a new connection takes the place of the oldest such connection of the peer holding "
        "the most of them, if that peer holds more than the newcomer's (else the newcomer is refused): peers that "
        "never authenticate cannot keep a tenant out. A health Watch stream on a connection that never "
        "authenticated ends with it: a monitor that watches makes an authenticated call first "
        "(ListDevices), or reconnects."))] = 10.0
    max_connections_per_peer_per_second: Annotated[float, Meta(gt=0, description=(
        "How fast one peer (as max_grpc_connections_per_peer names peers: a local user by its uid, a remote host by "
        "its /24 or /64) may open connections, on every listener of the front together (gRPC, <socket>.fast, the "
        "link's TCP and vsock ports, metrics, the vsock relay): a token bucket of connection_burst_per_peer, "
        "refilled at this rate. A connection past it is closed as soon as it is accepted, before any other work "
        "(audited, rate-limited, and counted in gpubroker_endpoint_refusals), so that a peer connecting and "
        "closing in a loop costs the front's event loop, which serves every tenant, next to nothing. A client "
        "opens two or three connections per session."))] = 200.0
    connection_burst_per_peer: Annotated[int, Meta(ge=1, description=(
        "The connections one peer may open at once, beyond max_connections_per_peer_per_second (a load test's "
        "many sessions starting together, a test holding a thousand segment connections)."))] = 2000
    max_grpc_calls_per_peer_per_second: Annotated[float, Meta(gt=0, description=(
        "How fast one peer (as max_connections_per_peer_per_second names peers) may start gRPC calls, "
        "authenticated or not, on all its connections together: a token bucket of grpc_call_burst_per_peer, "
        "refilled at this rate, checked before any other work of the call. A call past it is answered "
        "RESOURCE_EXHAUSTED at once, and the connection it came on is closed, so that a peer opening and "
        "cancelling calls in a loop (HTTP/2 rapid reset) must reconnect, which "
        "max_connections_per_peer_per_second limits. The client library makes a few unary calls per session "
        "(its commands ride one stream)."))] = 500.0
    grpc_call_burst_per_peer: Annotated[int, Meta(ge=1, description=(
        "The gRPC calls one peer may start at once, beyond max_grpc_calls_per_peer_per_second."))] = 1000
    max_grpc_control_frames_per_peer_per_second: Annotated[float, Meta(gt=0, description=(
        "How fast one peer (as max_connections_per_peer_per_second names peers) may send HTTP/2 frames that start no "
        "call (SETTINGS, WINDOW_UPDATE, PRIORITY, PING, GOAWAY, CONTINUATION, PUSH_PROMISE, unknown types, RST_STREAM "
        "beyond one per HEADERS, a DATA frame under 1 KiB unless empty and ending its stream, and each HEADERS: one "
        "token each, one more per 256 bytes of a HEADERS' or a control frame's payload) on all its cleartext gRPC "
        "connections together (Unix sockets, loopback TCP, vsock; a TLS connection is not read): a token bucket of "
        "grpc_control_frame_burst_per_peer, refilled at this rate. gRPC parses every frame in the front's process; the"
        " gate reads the headers of the frames it relays, and a connection whose frames go past its peer's rate is no "
        "longer relayed and is closed (its peer reconnects, at max_connections_per_peer_per_second). A client sends "
        "about four per unary call, about two per Commands batch and one per MiB a copy moves (a 256 MiB gRPC copy: 9 "
        "up, 270 down)."
        ))] = 50000.0
    grpc_control_frame_burst_per_peer: Annotated[int, Meta(ge=1, description=(
        "The control frames (as max_grpc_control_frames_per_peer_per_second counts them) one peer may send at "
        "once, beyond that rate."))] = 100000
    grpc_idle_seconds: Annotated[float, Meta(gt=0, description=(
        "A gRPC connection with no call in flight for this long is closed (HTTP/2 GOAWAY; a client reconnects "
        "at its next call): a connection that finished its handshake but never makes a call holds a slot of "
        "max_grpc_connections no longer than this."))] = 30.0
    max_grpc_streams_per_connection: Annotated[int, Meta(ge=1, description=(
        "Calls one gRPC connection may have open at once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS; a client queues "
        "more until one ends, past it gRPC refuses the stream). It also bounds the calls a peer can keep open "
        "without ever sending their request (gRPC waits for one with no deadline, and a connection with a call "
        "open is not idle): at most max_grpc_connections_per_peer times this, each holding at most 64 KiB of a "
        "request until it has authenticated (answered at once if it does not; one that does counts against its "
        "tenant's max_inflight_per_tenant, for at most request_message_timeout_seconds)."))] = 64
    request_message_timeout_seconds: Annotated[float, Meta(gt=0, description=(
        "How long a gRPC call (a unary request) may take to send its request message once it has authenticated; "
        "past it the call ends with DEADLINE_EXCEEDED and gives back its place among its tenant's "
        "max_inflight_per_tenant. A call also ends, its place given back, when its token is rotated or its tenant "
        "removed at a reload, and its credential is checked again once its message is read. A health request "
        "(served without a token) has as long to arrive, within its peer's max_health_streams_per_peer."))] = 30.0
    auth_failure_delay_max_seconds: Annotated[float, Meta(ge=0, description=(
        "The longest a peer's answer to a failed authentication is held back: the delay starts at 2 ms and doubles "
        "with each failure of that peer (uid on Unix sockets, address on TCP), so a guessing flood slows itself "
        "down and nobody else; 0: no delay."))] = 1.0
    connection_idle_seconds: Annotated[float, Meta(gt=0, description=(
        "An authenticated raw connection with no request for this long is closed."))] = 600.0
    fair_scheduling: Annotated[bool, Meta(description=(
        "Weighted fair time-slicing of each device; false: tenants' work reaches the device in arrival "
        "order."))] = True
    quantum_ms: Annotated[float, Meta(gt=0, description=(
        "The fair scheduler's time slice: how long one tenant's turn on a device lasts while others "
        "wait."))] = 5.0
    fast_path: Annotated[bool, Meta(description=(
        "Serve the command link on a Unix socket <socket>.fast beside each Unix listener: same-host clients "
        "then reach their worker directly after the front authenticates them (false: they use gRPC)."))] = True
    peer_copies: Annotated[Literal["auto", "host"], Meta(description=(
        "Copies between a tenant's sessions on two devices: auto takes the GPUs' peer path where CUDA allows "
        "it (else host memory); host always stages through host memory."))] = "auto"
    metrics_listen: Annotated[str, Meta(description=(
        "Serve Prometheus metrics at http://HOST:PORT/metrics (unauthenticated: keep it on loopback or a "
        "monitoring network); empty: off."))] = ""
    max_metrics_connections: Annotated[int, Meta(ge=1, description=(
        "Connections the metrics endpoint holds at once (it serves them on the broker's event loop, no thread "
        "each); more are closed as they are accepted, and counted in gpubroker_endpoint_refusals, unless the peer "
        "holding the most holds at least two more than the newcomer's: then its oldest is closed instead (peers "
        "at their share cannot keep a scraper out)."))] = 16
    max_metrics_connections_per_peer: Annotated[int, Meta(ge=1, description=(
        "The same, per peer (as max_grpc_connections_per_peer names peers: a local user by its uid, whatever its "
        "loopback address; a remote host by its /24 or /64): one peer's flood leaves the rest to Prometheus."))] = 4
    metrics_request_timeout_seconds: Annotated[float, Meta(gt=0, description=(
        "A metrics connection must send its whole request (at most 8 KiB of request line and headers) within "
        "this, and take its answer within this again; else it is closed."))] = 5.0
    metrics_refresh_seconds: Annotated[float, Meta(ge=0, description=(
        "The metrics figures are taken (a usage round trip to every worker with sessions) at most once per this "
        "interval: a scrape always gets figures taken after it arrived, and scrapes that come sooner wait for the "
        "next refresh and share it, so a scrape flood costs the workers and the event loop one refresh per "
        "interval."))] = 1.0
    metrics_requests_per_peer_per_second: Annotated[float, Meta(gt=0, description=(
        "Requests one peer (as max_metrics_connections_per_peer counts them) may have answered per second, "
        "whatever it asks for: more wait their turn "
        "(429 Too Many Requests when that is further off than metrics_request_timeout_seconds)."))] = 10.0
    max_health_streams: Annotated[int, Meta(ge=1, description=(
        "gRPC health Watch and server-reflection streams (both are served without a token and stay open until "
        "the peer ends them) open at once, in all; more are refused with RESOURCE_EXHAUSTED. The same number "
        "again of health Check requests still on their way in (a probe's arrives with its call at once; one sent "
        "slowly or never completed holds up to max_message_bytes of the broker's memory while it is read); Check "
        "calls themselves are not limited. At the total, a newcomer takes the place of (ends) the oldest of the "
        "peer holding the most, if it holds at least two more than the newcomer's: peers at their share cannot "
        "keep the readiness probe out."))] = 64
    max_health_streams_per_peer: Annotated[int, Meta(ge=1, description=(
        "The same (streams, and Check requests on their way in), per peer, as the gRPC listeners count peers: a "
        "local peer (Unix socket, or TCP from this host) by its uid, a remote one by its /24 (IPv4) or /64 "
        "(IPv6)."))] = 16
    log_format: Annotated[Literal["text", "json"], Meta(description=(
        "Log lines as text, or as JSON objects carrying the tenant, session and method when known."))] = "text"


class BrokerConfig(BrokerSettings, kw_only=True):
    """Everything `gpubroker serve` reads: the [broker] settings, [tls] and the tenants, and the file's path."""

    tls: TlsConfig | None = None
    tenants: dict[str, TenantConfig] = msgspec.field(default_factory=dict)
    path: Path | None = None  # the file it was read from: relative TLS paths and reloads start here

    def shared_limit(self, tenant: str) -> tuple[int, str]:
        """The host memory a tenant's sessions together may map as shared-memory segments, and the key that sets
        it: the tenant's own shared_memory (its memory quota unless set), within max_shared_bytes_per_tenant."""
        t = self.tenants.get(tenant)
        if t is not None:
            own, key = t.shared_quota()
            if own < self.max_shared_bytes_per_tenant:
                return own, f"[tenants.{tenant}] {key}"
        return self.max_shared_bytes_per_tenant, "max_shared_bytes_per_tenant"

    def add_tenant(self, tenant: TenantConfig) -> None:
        if not _NAME.match(tenant.name):
            raise InvalidArgument(f"tenant name {tenant.name!r} must be 1-64 of [A-Za-z0-9_.-]")
        if tenant.name in self.tenants:
            raise AlreadyExists(f"tenant {tenant.name!r} already exists")
        if tenant.weight < 1:
            raise InvalidArgument("weight must be >= 1")
        if tenant.memory_quota < 1 or any(q < 1 for q in tenant.device_memory.values()):
            raise InvalidArgument("memory quota must be > 0")
        if any(d < 0 for d in tenant.device_memory):
            raise InvalidArgument("device_memory names devices by their index (>= 0)")
        self.tenants[tenant.name] = tenant

    def remove_tenant(self, name: str) -> None:
        if name not in self.tenants:
            raise NotFound(f"no tenant {name!r}")
        del self.tenants[name]

