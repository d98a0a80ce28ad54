"""Run the broker: probe devices, start the grpc.aio server on its listeners, stop cleanly on signals."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import stat
import sys
from pathlib import Path

import grpc

from gpubroker.client import DeviceInfo, FailedPrecondition, InvalidArgument
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

from ..auth import Authenticator
from ..config import BrokerConfig
from ..sessions import SessionManager
from ..workers import WorkerPool, device_info_from_dict
from ._service import GpuBrokerService

__all__ = ["Broker", "probe_devices", "run_broker"]

log = logging.getLogger("gpubroker.server")


def probe_devices(backend: str) -> tuple[str, list[DeviceInfo]]:
    """Ask a throwaway process which devices the backend sees: the front never opens a device context."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "gpubroker.broker.workers", "--list", "--backend", backend],
                          capture_output=True, text=True, timeout=120)
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise FailedPrecondition(f"device probe failed: {proc.stderr.strip()[-2000:]}") from None
    if "error" in result:
        raise FailedPrecondition(f"no {result['backend']} devices: {result['error']}")
    return result["backend"], [device_info_from_dict(d) for d in result["devices"]]


def _prepare_unix_socket(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise InvalidArgument(f"{path} exists and is not a socket")
        path.unlink()  # a stale socket from a previous run


def _secure_unix_socket(path: Path, mode: int, group: str) -> None:
    if group:
        import grp

        try:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
        except KeyError:
            raise InvalidArgument(f"socket_group {group!r} does not exist") from None
    os.chmod(path, mode)


def tcp_credentials(cfg: BrokerConfig, address: str) -> grpc.ServerCredentials:
    """TLS when configured; plaintext only on loopback (local credentials) or when told --insecure."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "::1", "localhost"):
        return grpc.local_server_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    raise FailedPrecondition(f"refusing plaintext TCP on non-loopback {address}: configure [tls] or pass --insecure")


class Broker:
    """The front: one grpc.aio server, its sessions and its worker pool."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.server: grpc.aio.Server | None = None
        self.sessions: SessionManager | None = None
        self.pool: WorkerPool | None = None
        self.ports: list[str] = []

    async def start(self) -> None:
        cfg = self.config
        backend, devices = await asyncio.to_thread(probe_devices, cfg.backend)
        if cfg.devices is not None:
            missing = [d for d in cfg.devices if d >= len(devices)]
            if missing:
                raise FailedPrecondition(f"configured devices {missing} do not exist ({len(devices)} found)")
            devices = [devices[d] for d in cfg.devices]
        if not devices:
            raise FailedPrecondition(f"the {backend} backend found no devices")
        log.info("backend %s: %s", backend, ", ".join(f"{d.id}: {d.name}" for d in devices))
        self.pool = WorkerPool(backend, cfg.worker_start_timeout, cfg.worker_idle_seconds,
                               on_worker_exit=lambda w: self.sessions.worker_exited(w) if self.sessions else None)
        self.sessions = SessionManager(cfg, self.pool)
        self.auth = Authenticator(cfg)
        service = GpuBrokerService(cfg, self.auth, self.sessions, devices)
        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ])
        pb_grpc.add_GpuBrokerServicer_to_server(service, self.server)
        for address in cfg.listen:
            if address.startswith("unix:"):
                path = Path(address[len("unix:"):])
                _prepare_unix_socket(path)
                # Local credentials: the only way gRPC lets call credentials (the bearer token) ride a socket.
                self.server.add_secure_port(address, grpc.local_server_credentials(grpc.LocalConnectionType.UDS))
                self.ports.append(address)
            else:
                port = self.server.add_secure_port(address, tcp_credentials(cfg, address))
                self.ports.append(address.rsplit(":", 1)[0] + f":{port}")
        await self.server.start()
        for address in self.ports:
            if address.startswith("unix:"):
                _secure_unix_socket(Path(address[len("unix:"):]), cfg.socket_mode, cfg.socket_group)
        self.sessions.start()
        log.info("serving on %s", ", ".join(self.ports))

    async def stop(self, grace: float = 5.0) -> None:
        if self.server is not None:
            await self.server.stop(grace)
        if self.sessions is not None:
            await self.sessions.stop()
        if self.pool is not None:
            await self.pool.close()


async def _serve(config: BrokerConfig, ready_file: str | None) -> None:
    broker = Broker(config)
    await broker.start()
    if ready_file:
        # Written whole, then renamed: whoever waits for the file never reads half of it.
        tmp = Path(ready_file + ".tmp")
        tmp.write_text(json.dumps({"ports": broker.ports, "pid": os.getpid()}))
        tmp.replace(ready_file)
    print(f"gpubroker: serving on {', '.join(broker.ports)}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping")
    await broker.stop()


def run_broker(config: BrokerConfig, ready_file: str | None = None) -> None:
    """Serve until SIGTERM or SIGINT, on uvloop where it is installed."""
    try:
        import uvloop
    except ImportError:
        uvloop = None  # type: ignore[assignment]
    with contextlib.suppress(KeyboardInterrupt):
        if uvloop is not None:
            uvloop.run(_serve(config, ready_file))
        else:
            asyncio.run(_serve(config, ready_file))
