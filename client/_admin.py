"""AdminClient: the operator's side of the Admin service (needs a tenant with admin = true)."""

from __future__ import annotations

from typing import Any, TypeVar, cast

from gpubroker.v1 import admin_pb2 as apb
from gpubroker.v1 import admin_pb2_grpc as apb_grpc

from ._channel import make_channel, translated

R = TypeVar("R")

__all__ = ["AdminClient"]


class AdminClient:
    def __init__(self, target: str, token: str, *, timeout: float = 30.0, **channel_options: Any) -> None:
        self._channel, self._metadata = make_channel(target, token, **channel_options)
        self._stub = apb_grpc.AdminStub(self._channel)
        self.timeout = timeout

    def _call(self, method: str, request: Any, reply: type[R]) -> R:
        """``reply``: the response's message type (the generated stubs are untyped, so it is named here)."""
        return cast(R, translated(getattr(self._stub, method), request, metadata=self._metadata,
                                  timeout=self.timeout))

    def list_sessions(self, tenant: str = "") -> list[apb.SessionSummary]:
        reply = self._call("ListSessions", apb.ListSessionsRequest(tenant=tenant), apb.ListSessionsResponse)
        return list(reply.sessions)

    def end_session(self, session: str) -> apb.EndSessionResponse:
        return self._call("EndSession", apb.EndSessionRequest(session=session), apb.EndSessionResponse)

    def reload(self) -> apb.ReloadResponse:
        return self._call("Reload", apb.ReloadRequest(), apb.ReloadResponse)

    def usage(self, window_seconds: float = 0.0) -> apb.UsageResponse:
        """Per tenant and device: device time, share, queue, waits, device memory and its quota, sessions, and the
        host memory the tenant maps through the shared-memory side channel (``shared_bytes``, summed over all its
        sessions, against ``shared_bytes_limit``)."""
        return self._call("Usage", apb.UsageRequest(window_seconds=window_seconds), apb.UsageResponse)

    def drain(self, grace_seconds: float | None = None) -> apb.DrainResponse:
        """Refuse new sessions from now on; with a grace, the broker ends the sessions left after it."""
        request = apb.DrainRequest() if grace_seconds is None else apb.DrainRequest(grace_seconds=grace_seconds)
        return self._call("Drain", request, apb.DrainResponse)

    def status(self) -> apb.StatusResponse:
        return self._call("Status", apb.StatusRequest(), apb.StatusResponse)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
