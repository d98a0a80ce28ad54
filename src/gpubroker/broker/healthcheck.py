"""`python -m gpubroker.broker.healthcheck`: ask a local broker's grpc.health.v1 service, for exec probes.

Kubernetes' own gRPC probes cannot present a client certificate, so they cannot reach an mTLS listener; this
asks over the broker's Unix socket instead (local credentials, no token: health needs none).

Exit status 0: ready (the service is SERVING) or, with ``--live``, the broker answered at all (a draining broker
is NOT_SERVING yet alive: it must not be restarted mid-drain). 1: not ready or no answer; 2: bad arguments.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpubroker.wire.addresses import unix_path

__all__ = ["check", "main"]

DEFAULT_TARGET = "unix:/run/gpubroker/gpubroker.sock"
# Codes that mean nobody answered; any other status (even UNIMPLEMENTED) came from a live server.
_NO_ANSWER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def check(target: str = DEFAULT_TARGET, service: str = "", timeout: float = 5.0,
          live: bool = False) -> tuple[bool, str]:
    """(passed, what was seen) for one health check of the broker at ``target`` (``unix:PATH``)."""
    if unix_path(target) is None:
        raise ValueError(f"only unix: targets are supported, not {target!r} (TCP listeners need TLS)")
    credentials = grpc.local_channel_credentials(grpc.LocalConnectionType.UDS)
    with grpc.secure_channel(target, credentials) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout)
        except grpc.RpcError as exc:
            code = exc.code()
            return live and code not in _NO_ANSWER, f"{code.name}: {exc.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return live or reply.status == health_pb2.HealthCheckResponse.SERVING, status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpubroker.broker.healthcheck", description=__doc__.split("\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET, help=f"the broker's Unix socket (default {DEFAULT_TARGET})")
    parser.add_argument("--service", default="", help='health service name ("": the whole broker; '
                        '"gpubroker.v1.GpuBroker/device/N": device N)')
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    parser.add_argument("--live", action="store_true", help="pass on any answer, SERVING or not (liveness)")
    args = parser.parse_args(argv)
    try:
        passed, seen = check(args.target, args.service, args.timeout, args.live)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"{args.target} {args.service or '(broker)'}: {seen}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
