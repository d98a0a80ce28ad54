"""The broker's TOML config: listen addresses, limits and tenants (tokens stored only as salted hashes).

The schema is three msgspec Structs, one per kind of table: ``BrokerSettings`` ([broker]), ``TlsConfig`` ([tls]
and [tls.identities]) and ``TenantConfig`` ([tenants.NAME]). Every field carries its type, its range and a
description (the config reference is generated from them), so a wrong type, a value out of range or an unknown key
is refused by name rather than read loosely. ``load_config`` reads a file with tomllib; ``save_config`` writes a
whole config (tests, the launcher); ``edit_config`` and the ``*_in_place`` helpers change an operator's file with
tomlkit, keeping its comments and layout (`gpubroker tenant add | remove | rotate-token`).
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import logging
import os
import re
import tempfile
import tomllib
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import tomlkit
from msgspec import Meta

from gpubroker.client import AlreadyExists, InvalidArgument, NotFound

__all__ = [
    "DEFAULT_SOCKET",
    "BrokerConfig",
    "BrokerSettings",
    "TenantConfig",
    "TlsConfig",
    "add_tenant_in_place",
    "describe_type",
    "edit_config",
    "format_size",
    "load_config",
    "parse_config",
    "parse_size",
    "remove_tenant_in_place",
    "rotate_token_in_place",
    "save_config",
    "split_host_port",
]

log = logging.getLogger("gpubroker.config")

DEFAULT_SOCKET = "unix:/run/gpubroker/gpubroker.sock"
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}
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


def split_host_port(address: str) -> tuple[str, int]:
    """'127.0.0.1:9464' or '[::1]:9464' as (host, port); ValueError for anything else."""
    host, sep, port = address.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:9464), got {address!r}")
    return host, int(port)


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

    def quota_on(self, device: int) -> int:
        """The memory quota on one of the broker's devices."""
        return self.device_memory.get(device, self.memory_quota)


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
    socket_mode: Annotated[int, Meta(ge=0, le=0o777, description=(
        "The Unix sockets' permission mode, as an octal string (\"660\") or an int (0o660).")), OCTAL] = 0o660
    socket_group: Annotated[str, Meta(description=(
        "The group owning the Unix sockets (its members may connect); empty keeps the broker's."))] = ""
    insecure: Annotated[bool, Meta(description=(
        "Allow plaintext TCP on non-loopback addresses: tokens travel in the clear (warned at every "
        "start)."))] = False
    vsock_port: Annotated[int, Meta(ge=0, le=0xFFFFFFFF, description=(
        "Also accept VMs (vhost-vsock) on this AF_VSOCK port, relayed to the first unix listener; 0: off."))] = 0
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
        "Device calls in flight across all of a tenant's sessions."))] = 256
    max_shared_bytes_per_session: Annotated[int, Meta(ge=0, description=(
        "Host memory one session may map through the same-host shared-memory side channel <socket>.shm "
        "(its host arrays and its staging buffer).")), SIZE] = 4 * 1024**3
    max_shared_bytes_per_tenant: Annotated[int, Meta(ge=0, description=(
        "Host memory all of a tenant's sessions together may map through the side channel; shown in Usage and "
        "the metrics.")), SIZE] = 16 * 1024**3
    sandbox: Annotated[bool, Meta(description=(
        "Run every worker in a sandbox (namespaces, an allowlisted filesystem, seccomp, resource limits); "
        "false is warned at every start, and the broker refuses to start when it cannot sandbox unless this is "
        "false."))] = True
    cache_dir: Annotated[str, Meta(description=(
        "Where the per-tenant compile caches live, one private subdirectory each; empty: a directory of the "
        "broker's own under $STATE_DIRECTORY, $XDG_CACHE_HOME or ~/.cache."))] = ""
    worker_memory_max: Annotated[int, Meta(ge=0, description=(
        "Memory one worker may use (cgroup v2 memory.max where the broker may create cgroups, else an "
        "rlimit); 0: no limit.")), SIZE] = 0
    worker_pids_max: Annotated[int, Meta(ge=0, description=(
        "Processes and threads one worker may have (cgroup v2 pids.max, else an rlimit); 0: no limit."))] = 512
    worker_cpu_weight: Annotated[int, Meta(ge=1, le=10000, description=(
        "One worker's CPU weight against the others' (cgroup v2 cpu.weight, 1-10000)."))] = 100
    max_kernel_seconds: Annotated[float, Meta(ge=0, description=(
        "A tenant whose device work holds the device longer than this while another tenant waits has its "
        "worker killed; its calls fail with DEADLINE_EXCEEDED."))] = 10.0
    lone_kernel_seconds: Annotated[float, Meta(ge=0, description=(
        "The same limit for a tenant that nobody waits for; 0: a lone tenant may run kernels of any "
        "length."))] = 0.0
    tenant_crash_budget: Annotated[int, Meta(ge=0, description=(
        "A tenant whose workers die this often within the window (its kernels, its compiles) gets UNAVAILABLE "
        "with a retry hint for new sessions until a window passes; never counted against device health; "
        "0: no budget."))] = 5
    tenant_crash_window_seconds: Annotated[float, Meta(gt=0, description=(
        "The window of tenant_crash_budget."))] = 60.0
    hello_max_bytes: Annotated[int, Meta(ge=1, description=(
        "The largest hello a peer may send before it authenticates on the raw listeners (<socket>.fast, "
        "<socket>.shm).")), SIZE] = 64 * 1024
    hello_timeout_seconds: Annotated[float, Meta(gt=0, description=(
        "How long a peer on a raw listener may take to send its hello."))] = 5.0
    max_unauthenticated_connections: Annotated[int, Meta(ge=1, description=(
        "Unauthenticated connections the raw listeners keep open at once, in all; more are closed."))] = 256
    max_unauthenticated_per_uid: Annotated[int, Meta(ge=1, description=(
        "The same, per peer uid (SO_PEERCRED)."))] = 64
    connection_idle_seconds: Annotated[float, Meta(gt=0, description=(
        "An authenticated raw connection with no request for this long is closed."))] = 600.0
    fair_scheduling: Annotated[bool, Meta(description=(
        "Weighted fair time-slicing of each device; false: tenants' work reaches the device in arrival "
        "order."))] = True
    quantum_ms: Annotated[float, Meta(gt=0, description=(
        "The fair scheduler's time slice: how long one tenant's turn on a device lasts while others "
        "wait."))] = 5.0
    fast_path: Annotated[bool, Meta(description=(
        "Serve a raw Unix socket <socket>.fast beside each Unix listener for same-host synchronous "
        "calls."))] = True
    peer_copies: Annotated[Literal["auto", "host"], Meta(description=(
        "Copies between a tenant's sessions on two devices: auto takes the GPUs' peer path where CUDA allows "
        "it (else host memory); host always stages through host memory."))] = "auto"
    metrics_listen: Annotated[str, Meta(description=(
        "Serve Prometheus metrics at http://HOST:PORT/metrics (unauthenticated: keep it on loopback or a "
        "monitoring network); empty: off."))] = ""
    log_format: Annotated[Literal["text", "json"], Meta(description=(
        "Log lines as text, or as JSON objects carrying the tenant, session and method when known."))] = "text"


class BrokerConfig(BrokerSettings, kw_only=True):
    """Everything `gpubroker serve` reads: the [broker] settings, [tls] and the tenants, and the file's path."""

    tls: TlsConfig | None = None
    tenants: dict[str, TenantConfig] = msgspec.field(default_factory=dict)
    path: Path | None = None  # the file it was read from: relative TLS paths and reloads start here

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


# -- reading ---------------------------------------------------------------------------------------------------


def _fields(struct: type[msgspec.Struct]) -> dict[str, msgspec.structs.FieldInfo]:
    """A Struct's fields by their TOML name."""
    return {f.encode_name: f for f in msgspec.structs.fields(struct)}


_BROKER_KEYS = _fields(BrokerSettings)
_TLS_KEYS = _fields(TlsConfig)
_TENANT_KEYS = {k: f for k, f in _fields(TenantConfig).items() if k != "name"}  # the name is the table's


def _forms(field: msgspec.structs.FieldInfo) -> list[Any]:
    return list(getattr(field.type, "__metadata__", ()))


def describe_type(tp: Any) -> str:
    """A field's type as an operator reads it: ``int >= 1``, ``bool (true or false)``, ``"auto" | "cuda"``."""
    if typing.get_origin(tp) is Annotated:
        base, *extras = typing.get_args(tp)
        forms = [e for e in extras if isinstance(e, _Form)]
        if SIZE in forms and typing.get_origin(base) is dict:
            key, _ = typing.get_args(base)
            return f"a table of {describe_type(key)} = size (an int of bytes or a string like \"8GiB\")"
        if SIZE in forms:
            text = "a size (an int of bytes, or a string like \"8GiB\")"
        elif OCTAL in forms:
            text = "an octal mode (a string like \"660\", or an int like 0o660)"
        elif ONE_OR_MORE in forms:
            text = "a string or a list of strings"
        else:
            text = describe_type(base)
        bounds = []
        for meta in extras:
            if isinstance(meta, Meta):
                for name, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
                    value = getattr(meta, name)
                    if value is not None and not (OCTAL in forms and name == "ge"):
                        bounds.append(f"{sign} {oct(value) if OCTAL in forms else format(value, 'g')}")
                if meta.min_length is not None:
                    bounds.append("(not empty)" if meta.min_length == 1 else f"(at least {meta.min_length})")
                if meta.pattern is not None and meta.pattern == _NAME.pattern:
                    bounds.append("of 1-64 [A-Za-z0-9_.-]")
        return text + (" " + ", ".join(bounds) if bounds else "")
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(f'"{a}"' for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe_type(a) for a in args if a is not type(None))
    if origin is list:
        return f"a list of {describe_type(args[0])}"
    if origin is dict:
        return f"a table of {describe_type(args[0])} = {describe_type(args[1])}"
    simple = {bool: "bool (true or false)", int: "int", float: "number", str: "string"}
    return simple.get(tp, getattr(tp, "__name__", str(tp)))


def _toml_type(value: object) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, dict):
        return "table"
    if isinstance(value, list):
        return "array"
    return {int: "int", float: "float", str: "string"}.get(type(value), type(value).__name__)


class _Where:
    """Names what is being read in every message: the file and the table."""

    def __init__(self, source: str, table: str) -> None:
        self.source = source
        self.table = table

    def error(self, key: str, message: str, **details: Any) -> InvalidArgument:
        return InvalidArgument(f"{self.source}: [{self.table}] {key}: {message}", file=self.source,
                               table=self.table, key=key, **details)

    def wrong_type(self, key: str, field: msgspec.structs.FieldInfo, value: object, why: str = "") -> InvalidArgument:
        expected = describe_type(field.type)
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        return self.error(key, f"expected {expected}, got {_toml_type(value)} {shown}" + (f" ({why})" if why else ""),
                          expected=expected)

    def unknown(self, key: str, known: list[str]) -> InvalidArgument:
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = (f"; did you mean {close[0]}?" if close else f"; the keys of [{self.table}] are: {', '.join(known)}"
                if len(known) <= 12 else "; deploy/gpubroker.example.toml lists every key")
        return InvalidArgument(f"{self.source}: unknown key [{self.table}] {key}{hint}", file=self.source,
                               table=self.table, key=key, suggestion=close[0] if close else "")


def _normalize(where: _Where, table: dict[str, Any], fields: dict[str, msgspec.structs.FieldInfo]) -> dict[str, Any]:
    """Refuse unknown keys (naming a close match) and turn the TOML forms a field allows into its type."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        field = fields.get(key)
        if field is None:
            raise where.unknown(key, list(fields))
        forms = _forms(field)
        try:
            if SIZE in forms and isinstance(value, dict):
                value = {k: parse_size(v) if isinstance(v, str) else v for k, v in value.items()}
            elif SIZE in forms and isinstance(value, str):
                value = parse_size(value)
            elif OCTAL in forms and isinstance(value, str):
                value = int(value, 8)
            elif ONE_OR_MORE in forms and isinstance(value, str):
                value = [value]
        except (InvalidArgument, ValueError):
            raise where.wrong_type(key, field, table[key]) from None
        out[key] = value
    return out


def _convert(where: _Where, data: dict[str, Any], struct: type[msgspec.Struct],
             fields: dict[str, msgspec.structs.FieldInfo], original: dict[str, Any]) -> Any:
    try:
        return msgspec.convert(data, struct, str_keys=True)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = re.search(r"`\$\.(\w+)(\S*)`", text)
        missing = re.match(r"Object missing required field `(\w+)`", text)
        if missing:
            raise InvalidArgument(f"{where.source}: [{where.table}] lacks {missing.group(1)}", file=where.source,
                                  table=where.table, key=missing.group(1)) from None
        if match and match.group(1) in fields:
            key = match.group(1)
            # Within a list or a table: msgspec's own words say which element was wrong, and how.
            deeper = match.group(2) or " in `" in text
            detail = text.split(" - at ")[0]
            raise where.wrong_type(key, fields[key], original.get(key),
                                   detail[:1].lower() + detail[1:] if deeper else "") from None
        raise InvalidArgument(f"{where.source}: [{where.table}]: {text}", file=where.source,
                              table=where.table) from None


def _check_broker(where: _Where, s: BrokerSettings) -> None:
    """The rules that span keys or need more than a type and a range."""
    if s.chunk_bytes + 4096 > s.max_message_bytes:
        raise where.error("chunk_bytes", f"must leave 4096 bytes of room under max_message_bytes "
                          f"({s.max_message_bytes}), got {s.chunk_bytes}")
    if s.devices is not None and len(set(s.devices)) != len(s.devices):
        raise where.error("devices", f"must list distinct device indices, got {s.devices}")
    if s.metrics_listen.strip():
        try:
            split_host_port(s.metrics_listen)
        except ValueError as exc:
            raise where.error("metrics_listen", str(exc)) from None
    s.metrics_listen = s.metrics_listen.strip()
    for address in s.listen:
        if not address.strip():
            raise where.error("listen", "an address is empty (expected unix:PATH or HOST:PORT)")


def parse_config(data: dict[str, Any], source: str = "<config>", path: Path | None = None) -> BrokerConfig:
    """A BrokerConfig from a parsed TOML document; every problem is an InvalidArgument naming the key."""
    for key, value in data.items():
        if key not in ("broker", "tls", "tenants"):
            close = difflib.get_close_matches(key, ["broker", "tls", "tenants"], n=1, cutoff=0.6)
            hint = (f"; did you mean [{close[0]}]?" if close else f"; did you mean [broker] {key}?"
                    if key in _BROKER_KEYS else "; the tables are [broker], [tls] and [tenants.NAME]")
            raise InvalidArgument(f"{source}: unknown {'table' if isinstance(value, dict) else 'key'} {key}{hint}",
                                  file=source, key=key)
        if not isinstance(value, dict):
            raise InvalidArgument(f"{source}: {key} must be a table ([{key}]), got {_toml_type(value)}",
                                  file=source, key=key)
    where = _Where(source, "broker")
    broker = data.get("broker", {})
    settings: BrokerSettings = _convert(where, _normalize(where, broker, _BROKER_KEYS), BrokerSettings, _BROKER_KEYS,
                                        broker)
    _check_broker(where, settings)
    cfg = BrokerConfig(**msgspec.structs.asdict(settings), path=path)
    if "tls" in data:
        where = _Where(source, "tls")
        tls = data["tls"]
        identities = tls.get("identities", {})
        if isinstance(identities, dict):
            # The identities' own table: each value names a tenant, so a wrong type is named by its key there.
            ids = _Where(source, "tls.identities")
            for identity, tenant in identities.items():
                if not isinstance(tenant, str) or not _NAME.match(tenant):
                    raise ids.error(identity, f"expected a tenant's name (a string of 1-64 [A-Za-z0-9_.-]), got "
                                    f"{_toml_type(tenant)} {tenant!r}", expected="a tenant's name")
        cfg.tls = _convert(where, _normalize(where, tls, _TLS_KEYS), TlsConfig, _TLS_KEYS, tls)
    for name, table in data.get("tenants", {}).items():
        where = _Where(source, f"tenants.{name}")
        if not isinstance(table, dict):
            raise InvalidArgument(f"{source}: [tenants] {name}: expected a table [tenants.{name}], got "
                                  f"{_toml_type(table)}", file=source, table="tenants", key=name)
        if not _NAME.match(name):
            raise InvalidArgument(f"{source}: [tenants.{name}]: a tenant's name is 1-64 of [A-Za-z0-9_.-]",
                                  file=source, table=f"tenants.{name}")
        tenant = _convert(where, {**_normalize(where, table, _TENANT_KEYS), "name": name}, TenantConfig,
                          _TENANT_KEYS, table)
        cfg.add_tenant(tenant)
    if cfg.tls is not None:
        for identity, tenant_name in cfg.tls.identities.items():
            if tenant_name not in cfg.tenants:
                # Not an error: `tenant remove` leaves the mapping, which then authenticates nobody.
                close = difflib.get_close_matches(tenant_name, list(cfg.tenants), n=1, cutoff=0.6)
                log.warning("%s: [tls.identities] %r maps to %r, which is no tenant%s", source, identity,
                            tenant_name, f" (did you mean {close[0]!r}?)" if close else "")
    return cfg


def load_config(path: str | os.PathLike[str]) -> BrokerConfig:
    """Read a config; a missing file is an empty config (so `tenant add` can create it)."""
    path = Path(path)
    if not path.exists():
        return BrokerConfig(path=path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgument(f"{path}: {exc}", file=str(path)) from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{path}: cannot read it: {exc}", file=str(path)) from None
    return parse_config(data, str(path), path)


# -- writing ---------------------------------------------------------------------------------------------------
_HEADER = ("gpubroker config (see deploy/gpubroker.example.toml for every setting). It holds token hashes: "
           "keep it mode 0600.")


def _toml(field: msgspec.structs.FieldInfo, value: Any) -> Any:
    """A value as the file shows it: sizes with a unit where exact, modes in octal."""
    forms = _forms(field)
    if SIZE in forms and isinstance(value, dict):
        return _inline({str(k): _size(v) for k, v in sorted(value.items())})
    if SIZE in forms:
        return _size(value)
    if OCTAL in forms:
        return f"{value:o}"
    if isinstance(value, dict):
        return _inline({str(k): v for k, v in value.items()})
    return value


def _inline(values: dict[str, Any]) -> tomlkit.items.InlineTable:
    table = tomlkit.inline_table()
    table.update(values)
    return table


def _size(n: int) -> str | int:
    text = format_size(n)
    return text if not text.isdigit() else n


def _tenant_table(tenant: TenantConfig) -> tomlkit.items.Table:
    """A ``[tenants.NAME]`` table for ``tenant``, defaults left out except its memory and weight."""
    table = tomlkit.table()
    for key, field in _TENANT_KEYS.items():
        value = getattr(tenant, field.name)
        if key in ("token_id", "token_hash", "memory", "weight") or value != _default(field):
            table.add(key, _toml(field, value))
    return table


def _default(field: msgspec.structs.FieldInfo) -> Any:
    return field.default_factory() if field.default is msgspec.NODEFAULT else field.default


def _render(cfg: BrokerConfig) -> str:
    doc = tomlkit.document()
    doc.add(tomlkit.comment(_HEADER))
    broker = tomlkit.table()
    for key, field in _BROKER_KEYS.items():
        value = getattr(cfg, field.name)
        if value is not None:
            broker.add(key, _toml(field, value))
    doc.add("broker", broker)
    if cfg.tls is not None:
        tls = tomlkit.table()
        for key, field in _TLS_KEYS.items():
            if key != "identities":
                tls.add(key, getattr(cfg.tls, field.name))
        if cfg.tls.identities:
            ids = tomlkit.table()
            for identity, tenant in cfg.tls.identities.items():
                ids.add(identity, tenant)
            tls.add("identities", ids)
        doc.add("tls", tls)
    if cfg.tenants:
        tenants = tomlkit.table(is_super_table=True)
        for tenant in cfg.tenants.values():
            tenants.add(tenant.name, _tenant_table(tenant))
        doc.add("tenants", tenants)
    return doc.as_string()


def _write(target: Path, text: str) -> None:
    """Replace ``target`` atomically with a 0600 file (it holds token hashes), keeping its owner where allowed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        owner = target.stat()
    except FileNotFoundError:
        owner = None
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            if owner is not None and (owner.st_uid, owner.st_gid) != (os.getuid(), os.getgid()):
                # root editing the broker's own file: the broker (User=gpubroker) must still read it.
                with contextlib.suppress(PermissionError):
                    os.fchown(f.fileno(), owner.st_uid, owner.st_gid)
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself survives a crash only once the directory is synced
        dirfd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dirfd)
        finally:
            os.close(dirfd)


def save_config(cfg: BrokerConfig, path: str | os.PathLike[str] | None = None) -> Path:
    """Write a whole config atomically with mode 0600; the result is read back first, so it always loads."""
    target = Path(path or cfg.path or "gpubroker.toml")
    text = _render(cfg)
    parse_config(tomllib.loads(text), f"{target} (as written)", target)  # a bad setattr fails here, by its key
    _write(target, text)
    cfg.path = target
    return target


# -- editing in place ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def edit_config(path: str | os.PathLike[str]) -> Iterator[tuple[tomlkit.TOMLDocument, BrokerConfig]]:
    """Change an operator's file keeping its comments, order and layout.

    Yields the file as a tomlkit document and as a validated BrokerConfig (the caller changes both the same way).
    On a clean exit the edited document must load, and load to the same tenants as the BrokerConfig; then it
    replaces the file atomically (mode 0600). A missing file starts as a short header. Concurrent editors of
    the same directory take turns (flock on the directory), so neither loses the other's tenant.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    dirfd = os.open(target.parent, os.O_RDONLY)
    try:
        fcntl.flock(dirfd, fcntl.LOCK_EX)
        cfg = load_config(target)
        if target.exists():
            doc = tomlkit.parse(target.read_text())
        else:
            doc = tomlkit.document()
            doc.add(tomlkit.comment(_HEADER))
        yield doc, cfg
        text = doc.as_string()
        edited = parse_config(tomllib.loads(text), f"{target} (as edited)", target)
        if edited.tenants != cfg.tenants:
            raise InvalidArgument(f"{target}: the edit did not give the tenants intended; the file is unchanged")
        _write(target, text)
        cfg.path = target
    finally:
        os.close(dirfd)  # releases the lock


def _tenants_table(doc: tomlkit.TOMLDocument) -> Any:
    if "tenants" not in doc:
        doc.add("tenants", tomlkit.table(is_super_table=True))
    return doc["tenants"]


def add_tenant_in_place(path: str | os.PathLike[str], tenant: TenantConfig) -> Path:
    """Append a ``[tenants.NAME]`` table to the file; AlreadyExists if the tenant is there."""
    with edit_config(path) as (doc, cfg):
        cfg.add_tenant(tenant)
        table = _tenant_table(tenant)
        table.add(tomlkit.nl())  # a blank line before whatever table follows it
        _tenants_table(doc)[tenant.name] = table
    return Path(path)


def remove_tenant_in_place(path: str | os.PathLike[str], name: str) -> Path:
    """Delete the tenant's table (the rest of the file as it was); NotFound if there is none."""
    with edit_config(path) as (doc, cfg):
        cfg.remove_tenant(name)
        del _tenants_table(doc)[name]
        if not doc["tenants"]:
            del doc["tenants"]
    return Path(path)


def rotate_token_in_place(path: str | os.PathLike[str], name: str, token_id: str, token_hash: str) -> Path:
    """Replace the tenant's token_id and token_hash where they stand; NotFound if there is no such tenant."""
    with edit_config(path) as (doc, cfg):
        if name not in cfg.tenants:
            raise NotFound(f"no tenant {name!r}")
        tenant = cfg.tenants[name]
        tenant.token_id, tenant.token_hash = token_id, token_hash
        table = _tenants_table(doc)[name]
        table["token_id"] = token_id
        table["token_hash"] = token_hash
    return Path(path)
