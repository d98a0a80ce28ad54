from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModuleFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODULE_FORMAT_UNSPECIFIED: _ClassVar[ModuleFormat]
    MODULE_FORMAT_CUDA_C: _ClassVar[ModuleFormat]
    MODULE_FORMAT_OPENCL_C: _ClassVar[ModuleFormat]
    MODULE_FORMAT_PTX: _ClassVar[ModuleFormat]
    MODULE_FORMAT_CUBIN: _ClassVar[ModuleFormat]
    MODULE_FORMAT_FATBIN: _ClassVar[ModuleFormat]
MODULE_FORMAT_UNSPECIFIED: ModuleFormat
MODULE_FORMAT_CUDA_C: ModuleFormat
MODULE_FORMAT_OPENCL_C: ModuleFormat
MODULE_FORMAT_PTX: ModuleFormat
MODULE_FORMAT_CUBIN: ModuleFormat
MODULE_FORMAT_FATBIN: ModuleFormat

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("device", "client_name", "any_device")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    ANY_DEVICE_FIELD_NUMBER: _ClassVar[int]
    device: int
    client_name: str
    any_device: bool
    def __init__(self, device: _Optional[int] = ..., client_name: _Optional[str] = ..., any_device: _Optional[bool] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session", "lease_seconds", "max_chunk_bytes", "device", "link_port", "link_vsock_port")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LINK_PORT_FIELD_NUMBER: _ClassVar[int]
    LINK_VSOCK_PORT_FIELD_NUMBER: _ClassVar[int]
    session: str
    lease_seconds: float
    max_chunk_bytes: int
    device: DeviceInfo
    link_port: int
    link_vsock_port: int
    def __init__(self, session: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., max_chunk_bytes: _Optional[int] = ..., device: _Optional[_Union[DeviceInfo, _Mapping]] = ..., link_port: _Optional[int] = ..., link_vsock_port: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session", "cancel")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    session: str
    cancel: bool
    def __init__(self, session: _Optional[str] = ..., cancel: _Optional[bool] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_seconds",)
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    lease_seconds: float
    def __init__(self, lease_seconds: _Optional[float] = ...) -> None: ...

class ListDevicesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDevicesResponse(_message.Message):
    __slots__ = ("devices",)
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[DeviceInfo]
    def __init__(self, devices: _Optional[_Iterable[_Union[DeviceInfo, _Mapping]]] = ...) -> None: ...

class DeviceInfo(_message.Message):
    __slots__ = ("id", "name", "vendor", "backend", "total_memory", "free_memory", "multiprocessor_count", "clock_mhz", "l2_cache_bytes", "unified_memory", "max_threads_per_block", "max_block_dims", "max_grid_dims", "compute_capability", "opencl_version", "driver_version", "memory_quota", "memory_used", "memory_available", "health", "health_reason", "sandbox")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VENDOR_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MEMORY_FIELD_NUMBER: _ClassVar[int]
    FREE_MEMORY_FIELD_NUMBER: _ClassVar[int]
    MULTIPROCESSOR_COUNT_FIELD_NUMBER: _ClassVar[int]
    CLOCK_MHZ_FIELD_NUMBER: _ClassVar[int]
    L2_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNIFIED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    MAX_THREADS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCK_DIMS_FIELD_NUMBER: _ClassVar[int]
    MAX_GRID_DIMS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_CAPABILITY_FIELD_NUMBER: _ClassVar[int]
    OPENCL_VERSION_FIELD_NUMBER: _ClassVar[int]
    DRIVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    MEMORY_QUOTA_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    HEALTH_REASON_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_FIELD_NUMBER: _ClassVar[int]
    id: int
    name: str
    vendor: str
    backend: str
    total_memory: int
    free_memory: int
    multiprocessor_count: int
    clock_mhz: int
    l2_cache_bytes: int
    unified_memory: bool
    max_threads_per_block: int
    max_block_dims: _containers.RepeatedScalarFieldContainer[int]
    max_grid_dims: _containers.RepeatedScalarFieldContainer[int]
    compute_capability: _containers.RepeatedScalarFieldContainer[int]
    opencl_version: str
    driver_version: str
    memory_quota: int
    memory_used: int
    memory_available: int
    health: str
    health_reason: str
    sandbox: str
    def __init__(self, id: _Optional[int] = ..., name: _Optional[str] = ..., vendor: _Optional[str] = ..., backend: _Optional[str] = ..., total_memory: _Optional[int] = ..., free_memory: _Optional[int] = ..., multiprocessor_count: _Optional[int] = ..., clock_mhz: _Optional[int] = ..., l2_cache_bytes: _Optional[int] = ..., unified_memory: _Optional[bool] = ..., max_threads_per_block: _Optional[int] = ..., max_block_dims: _Optional[_Iterable[int]] = ..., max_grid_dims: _Optional[_Iterable[int]] = ..., compute_capability: _Optional[_Iterable[int]] = ..., opencl_version: _Optional[str] = ..., driver_version: _Optional[str] = ..., memory_quota: _Optional[int] = ..., memory_used: _Optional[int] = ..., memory_available: _Optional[int] = ..., health: _Optional[str] = ..., health_reason: _Optional[str] = ..., sandbox: _Optional[str] = ...) -> None: ...

class BufferHandle(_message.Message):
    __slots__ = ("handle", "size")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    handle: str
    size: int
    def __init__(self, handle: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class BufferRef(_message.Message):
    __slots__ = ("handle", "offset")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    handle: str
    offset: int
    def __init__(self, handle: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("session", "size")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    session: str
    size: int
    def __init__(self, session: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class FreeRequest(_message.Message):
    __slots__ = ("session", "buffer")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    session: str
    buffer: str
    def __init__(self, session: _Optional[str] = ..., buffer: _Optional[str] = ...) -> None: ...

class MemsetRequest(_message.Message):
    __slots__ = ("session", "buffer", "offset", "size", "value", "stream")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    session: str
    buffer: BufferRef
    offset: int
    size: int
    value: int
    stream: str
    def __init__(self, session: _Optional[str] = ..., buffer: _Optional[_Union[BufferRef, _Mapping]] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., value: _Optional[int] = ..., stream: _Optional[str] = ...) -> None: ...

class CopyDeviceToDeviceRequest(_message.Message):
    __slots__ = ("session", "src", "src_offset", "dst", "dst_offset", "size", "stream")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    SRC_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    DST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    session: str
    src: BufferRef
    src_offset: int
    dst: BufferRef
    dst_offset: int
    size: int
    stream: str
    def __init__(self, session: _Optional[str] = ..., src: _Optional[_Union[BufferRef, _Mapping]] = ..., src_offset: _Optional[int] = ..., dst: _Optional[_Union[BufferRef, _Mapping]] = ..., dst_offset: _Optional[int] = ..., size: _Optional[int] = ..., stream: _Optional[str] = ...) -> None: ...

class HostToDeviceHeader(_message.Message):
    __slots__ = ("session", "buffer", "offset", "size", "stream")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    session: str
    buffer: BufferRef
    offset: int
    size: int
    stream: str
    def __init__(self, session: _Optional[str] = ..., buffer: _Optional[_Union[BufferRef, _Mapping]] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., stream: _Optional[str] = ...) -> None: ...

class HostToDeviceChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: HostToDeviceHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[HostToDeviceHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class CopyDeviceToHostRequest(_message.Message):
    __slots__ = ("session", "buffer", "offset", "size", "chunk_bytes", "stream")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    session: str
    buffer: BufferRef
    offset: int
    size: int
    chunk_bytes: int
    stream: str
    def __init__(self, session: _Optional[str] = ..., buffer: _Optional[_Union[BufferRef, _Mapping]] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., stream: _Optional[str] = ...) -> None: ...

class DeviceToHostChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class LoadModuleRequest(_message.Message):
    __slots__ = ("session", "format", "image", "options")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    session: str
    format: ModuleFormat
    image: bytes
    options: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, session: _Optional[str] = ..., format: _Optional[_Union[ModuleFormat, str]] = ..., image: _Optional[bytes] = ..., options: _Optional[_Iterable[str]] = ...) -> None: ...

class ModuleHandle(_message.Message):
    __slots__ = ("handle", "kernel_names")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    KERNEL_NAMES_FIELD_NUMBER: _ClassVar[int]
    handle: str
    kernel_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, handle: _Optional[str] = ..., kernel_names: _Optional[_Iterable[str]] = ...) -> None: ...

class GetKernelRequest(_message.Message):
    __slots__ = ("session", "module", "name")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    MODULE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    session: str
    module: str
    name: str
    def __init__(self, session: _Optional[str] = ..., module: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class KernelHandle(_message.Message):
    __slots__ = ("handle", "name")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    handle: str
    name: str
    def __init__(self, handle: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ScalarArg(_message.Message):
    __slots__ = ("dtype", "value")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    value: bytes
    def __init__(self, dtype: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class KernelArg(_message.Message):
    __slots__ = ("buffer", "scalar")
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    SCALAR_FIELD_NUMBER: _ClassVar[int]
    buffer: BufferRef
    scalar: ScalarArg
    def __init__(self, buffer: _Optional[_Union[BufferRef, _Mapping]] = ..., scalar: _Optional[_Union[ScalarArg, _Mapping]] = ...) -> None: ...

class LaunchKernelRequest(_message.Message):
    __slots__ = ("session", "kernel", "grid", "block", "shared_mem", "stream", "args")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    SHARED_MEM_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    session: str
    kernel: str
    grid: _containers.RepeatedScalarFieldContainer[int]
    block: _containers.RepeatedScalarFieldContainer[int]
    shared_mem: int
    stream: str
    args: _containers.RepeatedCompositeFieldContainer[KernelArg]
    def __init__(self, session: _Optional[str] = ..., kernel: _Optional[str] = ..., grid: _Optional[_Iterable[int]] = ..., block: _Optional[_Iterable[int]] = ..., shared_mem: _Optional[int] = ..., stream: _Optional[str] = ..., args: _Optional[_Iterable[_Union[KernelArg, _Mapping]]] = ...) -> None: ...

class StreamHandle(_message.Message):
    __slots__ = ("handle",)
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    handle: str
    def __init__(self, handle: _Optional[str] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("session", "stream")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    session: str
    stream: str
    def __init__(self, session: _Optional[str] = ..., stream: _Optional[str] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("seq", "launch", "memset", "copy_d2d", "synchronize")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    LAUNCH_FIELD_NUMBER: _ClassVar[int]
    MEMSET_FIELD_NUMBER: _ClassVar[int]
    COPY_D2D_FIELD_NUMBER: _ClassVar[int]
    SYNCHRONIZE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    launch: LaunchKernelRequest
    memset: MemsetRequest
    copy_d2d: CopyDeviceToDeviceRequest
    synchronize: StreamRequest
    def __init__(self, seq: _Optional[int] = ..., launch: _Optional[_Union[LaunchKernelRequest, _Mapping]] = ..., memset: _Optional[_Union[MemsetRequest, _Mapping]] = ..., copy_d2d: _Optional[_Union[CopyDeviceToDeviceRequest, _Mapping]] = ..., synchronize: _Optional[_Union[StreamRequest, _Mapping]] = ...) -> None: ...

class CommandBatch(_message.Message):
    __slots__ = ("session", "batch", "commands", "encoded")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    ENCODED_FIELD_NUMBER: _ClassVar[int]
    session: str
    batch: int
    commands: _containers.RepeatedCompositeFieldContainer[Command]
    encoded: bytes
    def __init__(self, session: _Optional[str] = ..., batch: _Optional[int] = ..., commands: _Optional[_Iterable[_Union[Command, _Mapping]]] = ..., encoded: _Optional[bytes] = ...) -> None: ...

class CommandError(_message.Message):
    __slots__ = ("seq", "command", "code", "message")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    seq: int
    command: str
    code: str
    message: str
    def __init__(self, seq: _Optional[int] = ..., command: _Optional[str] = ..., code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class BatchAck(_message.Message):
    __slots__ = ("batch", "error", "encoded")
    BATCH_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ENCODED_FIELD_NUMBER: _ClassVar[int]
    batch: int
    error: CommandError
    encoded: bytes
    def __init__(self, batch: _Optional[int] = ..., error: _Optional[_Union[CommandError, _Mapping]] = ..., encoded: _Optional[bytes] = ...) -> None: ...

class CopySharedRequest(_message.Message):
    __slots__ = ("session", "segment", "segment_offset", "buffer", "offset", "size", "to_device", "stream")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    TO_DEVICE_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    session: str
    segment: str
    segment_offset: int
    buffer: BufferRef
    offset: int
    size: int
    to_device: bool
    stream: str
    def __init__(self, session: _Optional[str] = ..., segment: _Optional[str] = ..., segment_offset: _Optional[int] = ..., buffer: _Optional[_Union[BufferRef, _Mapping]] = ..., offset: _Optional[int] = ..., size: _Optional[int] = ..., to_device: _Optional[bool] = ..., stream: _Optional[str] = ...) -> None: ...

class CopyPeerRequest(_message.Message):
    __slots__ = ("src_session", "src", "src_offset", "dst_session", "dst", "dst_offset", "size")
    SRC_SESSION_FIELD_NUMBER: _ClassVar[int]
    SRC_FIELD_NUMBER: _ClassVar[int]
    SRC_OFFSET_FIELD_NUMBER: _ClassVar[int]
    DST_SESSION_FIELD_NUMBER: _ClassVar[int]
    DST_FIELD_NUMBER: _ClassVar[int]
    DST_OFFSET_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    src_session: str
    src: BufferRef
    src_offset: int
    dst_session: str
    dst: BufferRef
    dst_offset: int
    size: int
    def __init__(self, src_session: _Optional[str] = ..., src: _Optional[_Union[BufferRef, _Mapping]] = ..., src_offset: _Optional[int] = ..., dst_session: _Optional[str] = ..., dst: _Optional[_Union[BufferRef, _Mapping]] = ..., dst_offset: _Optional[int] = ..., size: _Optional[int] = ...) -> None: ...

class CopyPeerResponse(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...
