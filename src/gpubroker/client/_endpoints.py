"""Several brokers for one client: a new session goes to the first that is healthy and takes it.

Each endpoint is asked over grpc.health.v1 (no token needed) whether the device is SERVING, by its service name
``gpubroker.v1.GpuBroker/device/N`` (a broker that does not know the name answers for itself, ``""``); then
``OpenSession`` is tried there. An endpoint that is unreachable, not serving, draining or full (UNAVAILABLE,
RESOURCE_EXHAUSTED, or NOT_FOUND for a device it lacks) is skipped; when none takes the session, ``Unavailable``
names each endpoint's reason.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpubroker.client._channel import make_channel
from gpubroker.client._tls import TlsOptions
from gpubroker.wire.errors import GpuBrokerError, InvalidArgument, NotFound, ResourceExhausted, Unavailable

__all__ = ["HEALTH_TIMEOUT", "device_health_name", "place_session", "split_targets"]

# Seconds to wait for an endpoint's health answer before moving on to the next.
HEALTH_TIMEOUT = 5.0
# What OpenSession may answer that another endpoint might not.
_TRY_NEXT = (Unavailable, ResourceExhausted, NotFound)
T = TypeVar("T")


def split_targets(target: str | Sequence[str]) -> list[str]:
    """``"unix:/a.sock, host:7070"`` or ``["unix:/a.sock", "host:7070"]`` as a list of targets."""
    parts = target.split(",") if isinstance(target, str) else list(target)
    targets = [t.strip() for t in parts if isinstance(t, str) and t.strip()]
    if not targets or (not isinstance(target, str) and len(targets) != len(parts)):
        raise InvalidArgument(f"expected one or more broker addresses, got {target!r}")
    return targets


def device_health_name(device: int) -> str:
    return f"gpubroker.v1.GpuBroker/device/{device}"


def _health_problem(target: str, device: int | None, tls: TlsOptions | None, timeout: float) -> str | None:
    """Why ``target`` should not get the session (None: it says it serves, or it has no health service).

    With no device (the broker chooses), the broker's own status: SERVING while any device serves.
    """
    channel, _ = make_channel(target, None, tls)
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("",) if device is None else (device_health_name(device), ""):
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
            except grpc.RpcError as err:
                code = err.code()
                if code == grpc.StatusCode.NOT_FOUND:
                    continue  # a broker that does not name its devices: ask about the broker as a whole
                if code == grpc.StatusCode.UNIMPLEMENTED:
                    return None  # no health service at all: let OpenSession decide
                return f"health check failed: {code.name}: {err.details()}"
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return None
            what = f"device {device}" if service else "the broker"
            return f"{what} is {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
        return None
    finally:
        channel.close()


def place_session(targets: Sequence[str], device: int | None, tls: TlsOptions | None, open_on: Callable[[str], T],
                  health_timeout: float = HEALTH_TIMEOUT) -> T:
    """``open_on(target)`` on the first target that is healthy and takes the session; Unavailable if none does."""
    reasons: dict[str, str] = {}
    for target in targets:
        problem = _health_problem(target, device, tls, health_timeout)
        if problem is not None:
            reasons[target] = problem
            continue
        try:
            return open_on(target)
        except _TRY_NEXT as exc:
            reasons[target] = f"{exc.code}: {exc.message}"
        except GpuBrokerError:
            raise  # a bad token, a refused certificate: the same everywhere, so say so at once
    summary = "; ".join(f"{t}: {why}" for t, why in reasons.items())
    where = "any device" if device is None else f"device {device}"
    raise Unavailable(f"none of the {len(targets)} brokers took a session on {where}: {summary}",
                      endpoints=reasons)
