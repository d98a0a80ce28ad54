"""``connect``: a session on one broker, or on the first of several that is healthy and takes it."""

from __future__ import annotations

from collections.abc import Sequence

from gpubroker.client._endpoints import place_session, split_targets
from gpubroker.client._remote import RemoteGpu
from gpubroker.client._tls import TlsOptions

__all__ = ["connect"]


def connect(target: str | Sequence[str], token: str | None = None, device: int | None = None, *,
            tls: TlsOptions | None = None, async_commands: bool = False, transport: str = "auto",
            timeout: float | None = 300.0, shared_memory: bool = True, compress: str | None = "auto",
            vsock: bool | None = None, chunk_bytes: int | None = None,
            client_name: str = "gpubroker-python") -> RemoteGpu:
    """Open a session on ``device`` of the broker at ``target`` (``unix:/path`` or ``host:port``); without a device,
    on the one the broker chooses (the least loaded that serves and where the tenant has quota room).

    Several brokers (a list, or addresses separated by commas): the session goes to the first that is healthy and
    takes it; ``Unavailable`` names each one's reason when none does.

    The session is a [`RemoteGpu`][gpubroker.client.RemoteGpu], ready to use; use it as a context manager (or
    call `close()`) so the broker frees its memory at once rather than when its lease runs out.

    ```python
    target, token = os.environ["GPUBROKER_TARGET"], os.environ["GPUBROKER_TOKEN"]
    with connect(target, token=token, async_commands=True) as gpu:
        print(gpu.device_info().name)
    ```

    Args:
        target: The broker's address: `unix:/path/to/socket` on the same host (or in a container given the
            socket), `host:port` over TCP (`tls=` for TLS); or several, as a list or separated by commas.
        token: The tenant's token (`gpb_...`); None with a client certificate that names the tenant.
        device: The broker's device index; None lets the broker choose (`gpu.device` then says which).
        tls: TLS settings for `host:port` targets ([TlsOptions][gpubroker.client.TlsOptions]).
        async_commands: Queue commands and defer their errors to the next wait (`synchronize`), as CUDA does;
            False makes each command a round trip that raises its own error.
        transport: `"auto"`, `"ring"`, `"link"` or `"grpc"`: how device commands travel (`"auto"` takes the
            fastest the broker offers; see [`RemoteGpu`][gpubroker.client.RemoteGpu]).
        timeout: Seconds each call, and each wait for an acknowledgement, may take; None: no limit. A call past
            it raises `DeadlineExceeded`.
        shared_memory: Whether host copies on a `unix:` target may use shared memory with the broker's worker.
        compress: `"auto"`, `"lz4"` or None: lz4 for copies' bytes on links (`"auto"`: on TCP and vsock links).
        vsock: Whether to look for the broker's vsock link (in a VM guest); None: probe for one.
        chunk_bytes: The most bytes one copy command carries (the broker's limit caps it); None: the broker's.
        client_name: How the session names its client in the broker's logs.

    Returns:
        An open session.

    Raises:
        Unauthenticated: the token is missing or wrong (or the certificate names no tenant). With several
            brokers this is raised at once, not tried on the next.
        NotFound: the broker has no device `device`.
        ResourceExhausted: the tenant has as many sessions as the broker allows, or (no device named) no quota
            room on any serving device.
        Unavailable: the broker cannot be reached, is draining, or does not serve the device; or, with several,
            none took the session (`exc.details["endpoints"]` maps each address to its reason). Retry later or
            elsewhere.
        InvalidArgument: no address in `target`; an unknown `transport` or `compress`; a TLS file that cannot
            be read.
    """

    def open_on(one: str) -> RemoteGpu:
        gpu = RemoteGpu(one, token, device, tls=tls, async_commands=async_commands, transport=transport,
                        timeout=timeout, shared_memory=shared_memory, compress=compress, vsock=vsock,
                        chunk_bytes=chunk_bytes, client_name=client_name)
        try:
            gpu.initialize()
        except BaseException:
            gpu._channel.close()
            raise
        return gpu

    targets = split_targets(target)
    if len(targets) == 1:
        return open_on(targets[0])
    return place_session(targets, device, tls, open_on)
