"""The client's one transport seam: every device command goes through one Transport, chosen at connect.

``BatchingTransport`` is the one batching core (pending commands, sequence numbers, window, deferred errors);
``FramedLink`` carries its batches on a stream socket straight to the session's worker (Unix, TCP with TLS,
vsock), ``RingTransport`` through shared memory on the same host, ``GrpcCommands`` inside gRPC's ``Commands`` stream.
"""

from gpubroker.client._transports._choose import TRANSPORTS, choose_transport, in_vm, split_host_port
from gpubroker.client._transports._core import ENVELOPE, BatchingTransport, Lost, Transport, command_error
from gpubroker.client._transports._grpc import GrpcCommands
from gpubroker.client._transports._link import (
    VMADDR_CID_HOST,
    Connector,
    FramedLink,
    peer_hung_up,
    tcp_connector,
    unix_connector,
    vsock_connector,
)
from gpubroker.client._transports._ring import RingTransport

__all__ = [
    "ENVELOPE",
    "TRANSPORTS",
    "VMADDR_CID_HOST",
    "BatchingTransport",
    "Connector",
    "FramedLink",
    "GrpcCommands",
    "Lost",
    "RingTransport",
    "Transport",
    "choose_transport",
    "command_error",
    "in_vm",
    "peer_hung_up",
    "split_host_port",
    "tcp_connector",
    "unix_connector",
    "vsock_connector",
]
