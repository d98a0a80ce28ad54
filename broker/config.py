"""The broker's TOML config: listen addresses, limits and tenants (tokens stored only as salted hashes)."""

from __future__ import annotations

import os
import re
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from gpubroker.client import AlreadyExists, InvalidArgument, NotFound

__all__ = [
    "DEFAULT_SOCKET",
    "BrokerConfig",
    "TenantConfig",
    "TlsConfig",
    "format_size",
    "load_config",
    "parse_size",
    "save_config",
    "split_host_port",
]

DEFAULT_SOCKET = "unix:/run/gpubroker/gpubroker.sock"
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def parse_size(value: str | int) -> int:
    """'8GiB', '512MiB', '1000' or an int, as bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
    if not match or match.group(2).lower() not in _UNITS:
        raise InvalidArgument(f"not a size: {value!r} (examples: 8GiB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_size(n: int) -> str:
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


@dataclass
class TenantConfig:
    name: str
    token_id: str
    token_hash: str
    memory_quota: int = 8 * 1024**3  # on each device, unless device_memory says otherwise for one
    weight: int = 1
    admin: bool = False  # may call the Admin service (list and end sessions, reload)
    device_memory: dict[int, int] = field(default_factory=dict)  # broker device index -> its own quota

    def quota_on(self, device: int) -> int:
        """The memory quota on one of the broker's devices."""
        return self.device_memory.get(device, self.memory_quota)


@dataclass
class TlsConfig:
    """TLS for TCP listeners. With ``client_ca_file`` set, clients present certificates signed by it."""

    cert_file: str = ""
    key_file: str = ""
    client_ca_file: str = ""
    require_client_cert: bool = False
    allow_tokens: bool = True  # with client certificates, whether bearer tokens are still accepted
    # A client certificate's identity (its CN, or a SAN URI) -> tenant name; unmapped CNs name the tenant itself.
    identities: dict[str, str] = field(default_factory=dict)


@dataclass
class BrokerConfig:
    """Everything `gpubroker serve` reads; defaults suit a single host."""

    listen: list[str] = field(default_factory=lambda: [DEFAULT_SOCKET])
    backend: str = "auto"  # auto | cuda | opencl
    devices: list[int] | None = None  # None: every device the backend finds
    chunk_bytes: int = 1024 * 1024
    max_message_bytes: int = 4 * 1024 * 1024
    lease_seconds: float = 30.0
    worker_idle_seconds: float = 60.0
    worker_start_timeout: float = 60.0
    socket_mode: int = 0o660
    socket_group: str = ""  # group owning the Unix socket; empty keeps the broker's
    insecure: bool = False  # allow plaintext TCP on non-loopback addresses (logged loudly)
    vsock_port: int = 0  # also accept VMs on this AF_VSOCK port, relayed to the first unix listener; 0: off
    # Draining (SIGTERM, or Admin Drain with a grace): how long running sessions may go on before they are ended.
    drain_grace_seconds: float = 30.0
    # A device whose workers crash or fail to start this often within the window takes no new sessions (health
    # NOT_SERVING) until a window passes with no further failure; 0: never.
    device_failure_threshold: int = 3
    device_failure_window_seconds: float = 60.0
    # On CUDA with pynvml importable: a critical Xid other than an application error takes the device out of service.
    nvml_xid_events: bool = True
    # Limits: each one answered with RESOURCE_EXHAUSTED or INVALID_ARGUMENT, never an unbounded queue.
    max_sessions_per_tenant: int = 16
    max_concurrent_rpcs_per_session: int = 32
    max_handles_per_session: int = 4096
    max_module_bytes: int = 2 * 1024 * 1024
    compile_timeout_seconds: float = 60.0
    max_streams_per_session: int = 64
    max_inflight_per_tenant: int = 256  # device calls in flight across all of a tenant's sessions
    # Host memory a session may map through the shared-memory side channel (its segments and staging buffer).
    max_shared_bytes_per_session: int = 4 * 1024**3
    # ... and summed over all of a tenant's sessions (counted in Usage and the metrics).
    max_shared_bytes_per_tenant: int = 16 * 1024**3
    # Containment (see README "Security"): every worker runs in a sandbox unless this is false (warned at start).
    sandbox: bool = True
    # Per-tenant compile caches (PoCL's, NVRTC's/CuPy's) live under this directory, one private subdirectory each;
    # empty: a directory of the broker's own under $STATE_DIRECTORY, $XDG_CACHE_HOME or ~/.cache.
    cache_dir: str = ""
    # Per-worker resource limits (cgroup v2 where the broker may create cgroups, else rlimits); 0: no limit.
    worker_memory_max: int = 0
    worker_pids_max: int = 512
    worker_cpu_weight: int = 100
    # A tenant whose device work holds the device longer than this while another tenant waits has its worker
    # killed (its calls fail with DEADLINE_EXCEEDED); a lone tenant is limited by lone_kernel_seconds (0: never).
    max_kernel_seconds: float = 10.0
    lone_kernel_seconds: float = 0.0
    # A tenant whose workers die this often within the window (its kernels, its compiles) is refused new
    # sessions (UNAVAILABLE with a retry hint) until a window passes; it never counts against device health.
    tenant_crash_budget: int = 5
    tenant_crash_window_seconds: float = 60.0
    # Before authentication, on the raw listeners (<socket>.fast, <socket>.shm): the largest hello, how long
    # a peer may take to send it, how many unauthenticated connections may be open (in all and per peer uid),
    # and how long an authenticated connection may sit idle.
    hello_max_bytes: int = 64 * 1024
    hello_timeout_seconds: float = 5.0
    max_unauthenticated_connections: int = 256
    max_unauthenticated_per_uid: int = 64
    connection_idle_seconds: float = 600.0
    # Weighted fair time-slicing of each device; off, tenants' work reaches the device in arrival order.
    fair_scheduling: bool = True
    quantum_ms: float = 5.0
    # A raw Unix socket "<socket>.fast" beside each Unix listener for same-host synchronous calls.
    fast_path: bool = True
    # Copies between a tenant's sessions on two devices: "auto" takes the GPUs' peer path where CUDA allows it
    # (else host memory); "host" always stages through host memory.
    peer_copies: str = "auto"
    # Operations: a Prometheus /metrics endpoint on HOST:PORT (empty: off), and how log lines are written
    # ("text", or "json": one object a line carrying tenant, session and method when known).
    metrics_listen: str = ""
    log_format: str = "text"
    tls: TlsConfig | None = None
    tenants: dict[str, TenantConfig] = field(default_factory=dict)
    path: Path | None = None

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


def load_config(path: str | os.PathLike[str]) -> BrokerConfig:
    """Read a config; a missing file is an empty config (so `tenant add` can create it)."""
    path = Path(path)
    if not path.exists():
        return BrokerConfig(path=path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"{path}: {exc}") from exc
    broker = data.get("broker", {})
    cfg = BrokerConfig(path=path)
    if "listen" in broker:
        listen = broker["listen"]
        cfg.listen = [listen] if isinstance(listen, str) else list(listen)
    cfg.backend = str(broker.get("backend", cfg.backend))
    if cfg.backend not in ("auto", "cuda", "opencl"):
        raise InvalidArgument(f"{path}: backend must be auto, cuda or opencl, not {cfg.backend!r}")
    if "devices" in broker:
        cfg.devices = [int(d) for d in broker["devices"]]
        if len(set(cfg.devices)) != len(cfg.devices) or any(d < 0 for d in cfg.devices):
            raise InvalidArgument(f"{path}: [broker] devices must list distinct device indices, got {cfg.devices}")
    for key, parse in _SCALARS.items():
        if key in broker:
            try:
                setattr(cfg, key, parse(broker[key]))
            except (TypeError, ValueError) as exc:
                raise InvalidArgument(f"{path}: [broker] {key}: {exc}") from None
    if cfg.chunk_bytes < 1 or cfg.chunk_bytes + 4096 > cfg.max_message_bytes:
        raise InvalidArgument(f"{path}: chunk_bytes must be positive and leave room under max_message_bytes")
    if "tls" in data:
        tls = dict(data["tls"])
        unknown = set(tls) - {f for f in TlsConfig.__dataclass_fields__}
        if unknown:
            raise InvalidArgument(f"{path}: unknown [tls] keys {sorted(unknown)}")
        cfg.tls = TlsConfig(**tls)
    for name, t in data.get("tenants", {}).items():
        try:
            cfg.add_tenant(TenantConfig(
                name=name, token_id=str(t["token_id"]), token_hash=str(t["token_hash"]),
                memory_quota=parse_size(t.get("memory", 8 * 1024**3)), weight=int(t.get("weight", 1)),
                admin=bool(t.get("admin", False)), device_memory=_device_memory(t.get("device_memory", {}))))
        except KeyError as exc:
            raise InvalidArgument(f"{path}: tenant {name!r} lacks {exc.args[0]}") from None
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"{path}: tenant {name!r}: device_memory: {exc}") from None
    return cfg


def _device_memory(table: object) -> dict[int, int]:
    """``{ 1 = "16GiB" }`` (device index -> quota) as ints."""
    if not isinstance(table, dict):
        raise TypeError("expected a table of device index = size, e.g. { 1 = \"16GiB\" }")
    return {int(device): parse_size(size) for device, size in table.items()}


def split_host_port(address: str) -> tuple[str, int]:
    """'127.0.0.1:9464' or '[::1]:9464' as (host, port); ValueError for anything else."""
    host, sep, port = address.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:9464), got {address!r}")
    return host, int(port)


def _metrics_listen(value: object) -> str:
    text = str(value).strip()
    if text:
        split_host_port(text)
    return text


def _log_format(value: object) -> str:
    if value not in ("text", "json"):
        raise ValueError(f"expected \"text\" or \"json\", got {value!r}")
    return str(value)


def _peer_copies(value: object) -> str:
    if value not in ("auto", "host"):
        raise ValueError(f"expected \"auto\" or \"host\", got {value!r}")
    return str(value)


def _at_least(value: float, low: float) -> float:
    if value < low:
        raise ValueError(f"must be >= {low:g}, got {value:g}")
    return value


_SCALARS = {
    "chunk_bytes": parse_size, "max_message_bytes": parse_size, "lease_seconds": float,
    "worker_idle_seconds": float, "worker_start_timeout": float,
    "socket_mode": lambda v: int(v, 8) if isinstance(v, str) else int(v), "socket_group": str, "insecure": bool,
    "max_sessions_per_tenant": int, "max_concurrent_rpcs_per_session": int, "max_handles_per_session": int,
    "max_module_bytes": parse_size, "compile_timeout_seconds": float, "max_streams_per_session": int,
    "max_inflight_per_tenant": int, "fair_scheduling": bool, "quantum_ms": float, "fast_path": bool, "vsock_port": int,
    "max_shared_bytes_per_session": parse_size, "max_shared_bytes_per_tenant": parse_size,
    "sandbox": bool, "cache_dir": str, "worker_memory_max": parse_size, "worker_pids_max": int,
    "worker_cpu_weight": int, "max_kernel_seconds": float, "lone_kernel_seconds": float,
    "tenant_crash_budget": int, "tenant_crash_window_seconds": float, "hello_max_bytes": parse_size,
    "hello_timeout_seconds": float, "max_unauthenticated_connections": int, "max_unauthenticated_per_uid": int,
    "connection_idle_seconds": float,
    "drain_grace_seconds": lambda v: _at_least(float(v), 0.0),
    "device_failure_threshold": lambda v: _at_least(int(v), 0),
    "device_failure_window_seconds": lambda v: _at_least(float(v), 0.001),
    "nvml_xid_events": bool,
    "metrics_listen": _metrics_listen, "log_format": _log_format, "peer_copies": _peer_copies,
}


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    text = str(value)
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def save_config(cfg: BrokerConfig, path: str | os.PathLike[str] | None = None) -> Path:
    """Write atomically with mode 0600: the file holds token hashes."""
    target = Path(path or cfg.path or "gpubroker.toml")
    lines = ["# gpubroker config; tokens are stored only as salted scrypt hashes.", "[broker]"]
    lines.append(f"listen = {_toml_value(cfg.listen)}")
    lines.append(f"backend = {_toml_value(cfg.backend)}")
    if cfg.devices is not None:
        lines.append(f"devices = {_toml_value(cfg.devices)}")
    for key in _SCALARS:
        value = getattr(cfg, key)
        lines.append(f"{key} = {_toml_value(f'{value:o}' if key == 'socket_mode' else value)}")
    if cfg.tls is not None:
        lines += ["", "[tls]"]
        for key in TlsConfig.__dataclass_fields__:
            if key != "identities":
                lines.append(f"{key} = {_toml_value(getattr(cfg.tls, key))}")
        if cfg.tls.identities:
            lines += ["", "[tls.identities]"]
            lines += [f"{_toml_value(k)} = {_toml_value(v)}" for k, v in cfg.tls.identities.items()]
    for t in cfg.tenants.values():
        lines += ["", f"[tenants.{_toml_value(t.name)}]", f"token_id = {_toml_value(t.token_id)}",
                  f"token_hash = {_toml_value(t.token_hash)}", f"memory = {_toml_value(format_size(t.memory_quota))}",
                  f"weight = {t.weight}"]
        if t.admin:
            lines.append("admin = true")
        if t.device_memory:
            quotas = ", ".join(f'{d} = "{format_size(q)}"' for d, q in sorted(t.device_memory.items()))
            lines.append(f"device_memory = {{ {quotas} }}")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".gpubroker-", suffix=".toml")
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.chmod(tmp, 0o600)
    os.replace(tmp, target)
    cfg.path = target
    return target
