"""``connect``: a session on one broker, or on the first of several that is healthy and takes it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._endpoints import place_session, split_targets
from ._remote import RemoteGpu
from ._tls import TlsOptions

__all__ = ["connect"]


def connect(target: str | Sequence[str], token: str | None = None, device: int | None = None, *,
            tls: TlsOptions | None = None, **kwargs: Any) -> RemoteGpu:
    """Open a session on ``device`` of the broker at ``target`` (``unix:/path`` or ``host:port``); without a device,
    on the one the broker chooses (the least loaded that serves and where the tenant has quota room).

    Several brokers (a list, or addresses separated by commas): the session goes to the first that is healthy and
    takes it; ``Unavailable`` names each one's reason when none does.
    """

    def open_on(one: str) -> RemoteGpu:
        gpu = RemoteGpu(one, token, device, tls=tls, **kwargs)
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
