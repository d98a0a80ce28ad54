"""The client's one transport seam: every device command goes through one Transport, chosen at connect.

``BatchingTransport`` is the one batching core (pending commands, sequence numbers, window, deferred errors); it
owns a ``Carrier`` that moves its batches on one medium: ``FramedSocket`` on a stream socket straight to the
session's worker (Unix, TCP with TLS, vsock; ``framed_link``), ``RingUpgrade`` through shared memory on the same
host over the Unix link it upgrades (``ring_transport``), ``GrpcStream`` inside gRPC's ``Commands`` stream
(``grpc_commands``). A TCP link's transport is given ``Stripes``: further links that large copies are dealt over.
"""

from gpubroker.client._transports._choose import TRANSPORTS, choose_transport, in_vm, split_host_port
from gpubroker.client._transports._core import (
    ENVELOPE,
    BatchingTransport,
    Carrier,
    Lost,
    Stripes,
    Transport,
    command_error,
)
from gpubroker.client._transports._grpc import GrpcStream, grpc_commands
from gpubroker.client._transports._link import (
    VMADDR_CID_HOST,
    Connector,
    FramedSocket,
    framed_link,
    peer_hung_up,
    tcp_connector,
    unix_connector,
    vsock_connector,
)
from gpubroker.client._transports._ring import RingUpgrade, ring_transport

__all__ = [
    "ENVELOPE",
    "TRANSPORTS",
    "VMADDR_CID_HOST",
    "BatchingTransport",
    "Carrier",
    "Connector",
    "FramedSocket",
    "GrpcStream",
    "Lost",
    "RingUpgrade",
    "Stripes",
    "Transport",
    "choose_transport",
    "command_error",
    "framed_link",
    "grpc_commands",
    "in_vm",
    "peer_hung_up",
    "ring_transport",
    "split_host_port",
    "tcp_connector",
    "unix_connector",
    "vsock_connector",
]
