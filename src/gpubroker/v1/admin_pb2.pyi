from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListSessionsRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class SessionSummary(_message.Message):
    __slots__ = ("session", "tenant", "device", "idle_seconds", "memory_used", "lost", "worker_pid")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    IDLE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    WORKER_PID_FIELD_NUMBER: _ClassVar[int]
    session: str
    tenant: str
    device: int
    idle_seconds: float
    memory_used: int
    lost: str
    worker_pid: int
    def __init__(self, session: _Optional[str] = ..., tenant: _Optional[str] = ..., device: _Optional[int] = ..., idle_seconds: _Optional[float] = ..., memory_used: _Optional[int] = ..., lost: _Optional[str] = ..., worker_pid: _Optional[int] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionSummary]
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionSummary, _Mapping]]] = ...) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ("tenant", "memory_freed")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FREED_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    memory_freed: int
    def __init__(self, tenant: _Optional[str] = ..., memory_freed: _Optional[int] = ...) -> None: ...

class ReloadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadResponse(_message.Message):
    __slots__ = ("added", "removed", "changed", "sessions_ended")
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_ENDED_FIELD_NUMBER: _ClassVar[int]
    added: _containers.RepeatedScalarFieldContainer[str]
    removed: _containers.RepeatedScalarFieldContainer[str]
    changed: _containers.RepeatedScalarFieldContainer[str]
    sessions_ended: int
    def __init__(self, added: _Optional[_Iterable[str]] = ..., removed: _Optional[_Iterable[str]] = ..., changed: _Optional[_Iterable[str]] = ..., sessions_ended: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("grace_seconds",)
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    grace_seconds: float
    def __init__(self, grace_seconds: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("sessions_running", "sessions", "seconds_left")
    SESSIONS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    sessions_running: int
    sessions: _containers.RepeatedCompositeFieldContainer[SessionSummary]
    seconds_left: float
    def __init__(self, sessions_running: _Optional[int] = ..., sessions: _Optional[_Iterable[_Union[SessionSummary, _Mapping]]] = ..., seconds_left: _Optional[float] = ...) -> None: ...

class UndrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UndrainResponse(_message.Message):
    __slots__ = ("was_draining", "sessions_running")
    WAS_DRAINING_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_RUNNING_FIELD_NUMBER: _ClassVar[int]
    was_draining: bool
    sessions_running: int
    def __init__(self, was_draining: _Optional[bool] = ..., sessions_running: _Optional[int] = ...) -> None: ...

class UsageRequest(_message.Message):
    __slots__ = ("window_seconds",)
    WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    window_seconds: float
    def __init__(self, window_seconds: _Optional[float] = ...) -> None: ...

class TenantUsage(_message.Message):
    __slots__ = ("tenant", "device", "weight", "device_seconds", "share", "queued", "inflight", "wait_p50_ms", "wait_p99_ms", "memory_used", "memory_quota", "sessions", "shared_bytes", "shared_bytes_limit")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    WAIT_P50_MS_FIELD_NUMBER: _ClassVar[int]
    WAIT_P99_MS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_QUOTA_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    SHARED_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_BYTES_LIMIT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    device: int
    weight: float
    device_seconds: float
    share: float
    queued: int
    inflight: int
    wait_p50_ms: float
    wait_p99_ms: float
    memory_used: int
    memory_quota: int
    sessions: int
    shared_bytes: int
    shared_bytes_limit: int
    def __init__(self, tenant: _Optional[str] = ..., device: _Optional[int] = ..., weight: _Optional[float] = ..., device_seconds: _Optional[float] = ..., share: _Optional[float] = ..., queued: _Optional[int] = ..., inflight: _Optional[int] = ..., wait_p50_ms: _Optional[float] = ..., wait_p99_ms: _Optional[float] = ..., memory_used: _Optional[int] = ..., memory_quota: _Optional[int] = ..., sessions: _Optional[int] = ..., shared_bytes: _Optional[int] = ..., shared_bytes_limit: _Optional[int] = ...) -> None: ...

class UsageResponse(_message.Message):
    __slots__ = ("tenants", "fair_scheduling", "quantum_ms")
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    FAIR_SCHEDULING_FIELD_NUMBER: _ClassVar[int]
    QUANTUM_MS_FIELD_NUMBER: _ClassVar[int]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantUsage]
    fair_scheduling: bool
    quantum_ms: float
    def __init__(self, tenants: _Optional[_Iterable[_Union[TenantUsage, _Mapping]]] = ..., fair_scheduling: _Optional[bool] = ..., quantum_ms: _Optional[float] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeviceStatus(_message.Message):
    __slots__ = ("device", "name", "backend", "total_memory", "health", "reason", "recent_worker_failures", "sessions", "memory_used")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MEMORY_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RECENT_WORKER_FAILURES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    device: int
    name: str
    backend: str
    total_memory: int
    health: str
    reason: str
    recent_worker_failures: int
    sessions: int
    memory_used: int
    def __init__(self, device: _Optional[int] = ..., name: _Optional[str] = ..., backend: _Optional[str] = ..., total_memory: _Optional[int] = ..., health: _Optional[str] = ..., reason: _Optional[str] = ..., recent_worker_failures: _Optional[int] = ..., sessions: _Optional[int] = ..., memory_used: _Optional[int] = ...) -> None: ...

class TenantStatus(_message.Message):
    __slots__ = ("tenant", "weight", "memory_quota", "admin", "sessions", "memory_used")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    MEMORY_QUOTA_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    weight: int
    memory_quota: int
    admin: bool
    sessions: int
    memory_used: int
    def __init__(self, tenant: _Optional[str] = ..., weight: _Optional[int] = ..., memory_quota: _Optional[int] = ..., admin: _Optional[bool] = ..., sessions: _Optional[int] = ..., memory_used: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("version", "uptime_seconds", "health", "draining", "drain_seconds_left", "devices", "tenants", "sandbox")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DRAIN_SECONDS_LEFT_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_seconds: float
    health: str
    draining: bool
    drain_seconds_left: float
    devices: _containers.RepeatedCompositeFieldContainer[DeviceStatus]
    tenants: _containers.RepeatedCompositeFieldContainer[TenantStatus]
    sandbox: str
    def __init__(self, version: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., health: _Optional[str] = ..., draining: _Optional[bool] = ..., drain_seconds_left: _Optional[float] = ..., devices: _Optional[_Iterable[_Union[DeviceStatus, _Mapping]]] = ..., tenants: _Optional[_Iterable[_Union[TenantStatus, _Mapping]]] = ..., sandbox: _Optional[str] = ...) -> None: ...
