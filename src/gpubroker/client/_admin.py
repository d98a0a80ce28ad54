"""AdminClient: the operator's side of the Admin service (needs a tenant with admin = true)."""

from __future__ import annotations

from typing import Any, TypeVar, cast

from gpubroker.client._channel import make_channel, translated
from gpubroker.v1 import admin_pb2 as apb
from gpubroker.v1 import admin_pb2_grpc as apb_grpc

R = TypeVar("R")

__all__ = ["AdminClient"]


class AdminClient:
    """The operator's client of a broker's Admin service: sessions, reload, usage, drain and status.

    Every call needs an admin identity: the token (or client certificate) of a tenant with `admin = true` in the
    broker's config; any other tenant gets `PermissionDenied`. The `gpubroker status`, `sessions`, `end-session`,
    `drain` and `admin ...` commands are this client. Replies are the Admin service's protobuf messages
    (`gpubroker.v1.admin_pb2`); their fields are described in `gpubroker/v1/admin.proto`.

    ```python
    with AdminClient(os.environ["GPUBROKER_TARGET"], os.environ["GPUBROKER_ADMIN_TOKEN"]) as admin:
        print(admin.status().health)
    ```

    Every method may raise `Unauthenticated` (a missing or wrong token), `PermissionDenied` (not an admin
    tenant), `Unavailable` (the broker cannot be reached) or `DeadlineExceeded` (no answer within `timeout`).

    Args:
        target: The broker's address (`unix:/path` or `host:port`).
        token: An admin tenant's token.
        timeout: Seconds each call may take.
        **channel_options: Passed to the channel: `tls=` ([TlsOptions][gpubroker.client.TlsOptions]) for
            `host:port` targets.
    """

    def __init__(self, target: str, token: str, *, timeout: float = 30.0, **channel_options: Any) -> None:
        self._channel, self._metadata = make_channel(target, token, **channel_options)
        self._stub = apb_grpc.AdminStub(self._channel)
        self.timeout = timeout
        """Seconds each call may take."""

    def _call(self, method: str, request: Any, reply: type[R]) -> R:
        """``reply``: the response's message type (the generated stubs are untyped, so it is named here)."""
        return cast(R, translated(getattr(self._stub, method), request, metadata=self._metadata,
                                  timeout=self.timeout))

    def list_sessions(self, tenant: str = "") -> list[apb.SessionSummary]:
        """The sessions open on the broker.

        Args:
            tenant: Only this tenant's; empty for every tenant's.

        Returns:
            One summary per session: its id, tenant, device, seconds idle, device memory held, its worker's pid,
                and `lost` (why its device state is gone, if its worker died).

        Raises:
            PermissionDenied: the token is not an admin tenant's.
        """
        reply = self._call("ListSessions", apb.ListSessionsRequest(tenant=tenant), apb.ListSessionsResponse)
        return list(reply.sessions)

    def end_session(self, session: str) -> apb.EndSessionResponse:
        """End a session of any tenant and free its device memory; its client's next call gets `NotFound`.

        Args:
            session: The session's id (from [`list_sessions`][gpubroker.client.AdminClient.list_sessions]).

        Returns:
            The session's tenant and the bytes of device memory freed.

        Raises:
            NotFound: no session with that id.
            PermissionDenied: the token is not an admin tenant's.
        """
        return self._call("EndSession", apb.EndSessionRequest(session=session), apb.EndSessionResponse)

    def reload(self) -> apb.ReloadResponse:
        """Re-read the tenants from the broker's config file, as SIGHUP does.

        New tenants can connect at once; changed quotas and weights apply to running sessions; connections opened
        with a rotated token are closed, and the sessions on workers that ran anything for it end (those workers are
        ended: their buffers are lost); removed tenants' sessions end.

        Returns:
            The tenants added, removed and changed, and how many sessions ended.

        Raises:
            InvalidArgument: the config file does not parse or validate; the broker keeps its current tenants.
            PermissionDenied: the token is not an admin tenant's.
        """
        return self._call("Reload", apb.ReloadRequest(), apb.ReloadResponse)

    def usage(self, window_seconds: float = 0.0) -> apb.UsageResponse:
        """Per tenant and device: device time, share, queue, waits, device memory and its quota, sessions, and the
        host memory the tenant maps through the same-host shared memory (``shared_bytes``, summed over all its
        sessions, against ``shared_bytes_limit``).

        Args:
            window_seconds: The window over which `share` (the tenant's fraction of the device's time) is
                measured; 0 for the default, 10 s.

        Returns:
            One row per tenant and device (`tenants`), and whether fair scheduling is on, with its quantum.

        Raises:
            PermissionDenied: the token is not an admin tenant's.
        """
        return self._call("Usage", apb.UsageRequest(window_seconds=window_seconds), apb.UsageResponse)

    def drain(self, grace_seconds: float | None = None) -> apb.DrainResponse:
        """Refuse new sessions from now on; with a grace, the broker ends the sessions left after it.

        Every health status turns `NOT_SERVING` and new sessions get `Unavailable` with a retry hint; running
        sessions go on. `undrain` ends it; a later drain may shorten the grace, never lengthen it. The broker stays
        up: stop it with SIGTERM.

        Args:
            grace_seconds: Seconds the running sessions may go on before the broker ends them; None lets them run
                until they close.

        Returns:
            The sessions still running and, with a grace, the seconds until they are ended.

        Raises:
            InvalidArgument: a negative or infinite grace.
            PermissionDenied: the token is not an admin tenant's.
        """
        request = apb.DrainRequest() if grace_seconds is None else apb.DrainRequest(grace_seconds=grace_seconds)
        return self._call("Drain", request, apb.DrainResponse)

    def undrain(self) -> apb.UndrainResponse:
        """End a drain: new sessions are taken again, every device's health is its own again, and a grace not yet
        over no longer ends the sessions left.

        Returns:
            Whether the broker was draining, and the sessions running.

        Raises:
            PermissionDenied: the token is not an admin tenant's.
        """
        return self._call("Undrain", apb.UndrainRequest(), apb.UndrainResponse)

    def status(self) -> apb.StatusResponse:
        """The broker at a glance, as `gpubroker status` prints it.

        Returns:
            The broker's version, uptime, health, drain state and sandbox; each device with its health, recent
                worker failures, sessions and memory use; each tenant with its weight, quota, sessions and memory.

        Raises:
            PermissionDenied: the token is not an admin tenant's.
        """
        return self._call("Status", apb.StatusRequest(), apb.StatusResponse)

    def close(self) -> None:
        """Close the connection to the broker; `with AdminClient(...) as admin:` calls it on leaving the block."""
        self._channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
