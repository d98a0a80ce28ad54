"""Run the broker: probe devices, start the grpc.aio server on its listeners, stop cleanly on signals."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import functools
import json
import logging
import os
import resource
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from gpubroker.broker.config import BrokerConfig, load_config
from gpubroker.broker.front import _systemd
from gpubroker.broker.front._acceptor import AcceptorProcess
from gpubroker.broker.front._admin import AdminService
from gpubroker.broker.front._cpuwatch import CpuWatch
from gpubroker.broker.front._credentials import check_listeners, loopback_address, tcp_credentials
from gpubroker.broker.front._descriptors import PASSRIGHTS_SUPPORTED
from gpubroker.broker.front._grpc_peers import GrpcGate
from gpubroker.broker.front._health import BrokerHealth
from gpubroker.broker.front._links import LinkServer, fast_path_address
from gpubroker.broker.front._memwatch import MemoryWatch, describe_bound
from gpubroker.broker.front._metrics import BrokerCollector, MetricsLimits, MetricsServer, serve_metrics
from gpubroker.broker.front._preauth import PreAuthGate
from gpubroker.broker.front._segments import SegmentService
from gpubroker.broker.front._service import GpuBrokerService
from gpubroker.broker.front._sessions import Session, SessionManager
from gpubroker.broker.front._status import add_servicer
from gpubroker.broker.front._tls_relays import TlsRelays
from gpubroker.broker.front.auth import Authenticator
from gpubroker.broker.front.listen import listen_unix, listen_vsock, secure_unix_socket
from gpubroker.broker.front.listeners import PeerNetworks, PeerRate
from gpubroker.broker.front.scheduler import DeviceScheduler, Metered
from gpubroker.broker.front.workers import (
    WorkerClient,
    WorkerPool,
    Zygote,
    cpu_count,
    device_info_from_dict,
    hold_seconds,
)
from gpubroker.broker.logs import json_logging
from gpubroker.broker.sandbox import SandboxUnavailable, WorkerSandbox, cache_key
from gpubroker.v1 import admin_pb2 as apb
from gpubroker.v1 import admin_pb2_grpc as apb_grpc
from gpubroker.v1 import broker_pb2_grpc as pb_grpc
from gpubroker.wire.addresses import parse_host_port, unix_path
from gpubroker.wire.errors import DeadlineExceeded, FailedPrecondition, GpuBrokerError, Unavailable
from gpubroker.wire.types import DeviceInfo

__all__ = ["Broker", "probe_devices", "run_broker", "tcp_credentials"]

log = logging.getLogger("gpubroker.server")
# Seconds a drain that ran out of grace waits for the sessions it ends to close before the broker stops regardless.
_CLOSE_MARGIN = 5.0
# Seconds a reload's answer waits for the workers to take their new limits (those that answer later take them all
# the same, before anything the front sends them after).
_LIMITS_WAIT = 1.0
# Seconds each worker has at least, at the broker's stop, to exit once its channel is closed before it is killed.
_WORKER_EXIT_SECONDS = 1.0
audit = logging.getLogger("gpubroker.audit")
# HTTP/2 keepalive: the broker pings each client connection after this long without traffic and drops one whose
# answer takes longer than the timeout, so a client that vanished without closing (a host gone, a VM paused)
# cannot hold its calls, their concurrency slots and their buffered chunks forever. Clients ping every 30 s
# (gpubroker/client/_channel.py), which this allows even between calls.
KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000
MIN_CLIENT_PING_INTERVAL_MS = 10_000


def probe_devices(backend: str) -> tuple[str, list[DeviceInfo]]:
    """Ask a throwaway process which devices the backend sees: the front never opens a device context."""
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "gpubroker.broker.worker", "--list", "--backend", backend],
                          capture_output=True, text=True, timeout=120)
    try:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise FailedPrecondition(f"device probe failed: {proc.stderr.strip()[-2000:]}") from None
    if "error" in result:
        raise FailedPrecondition(f"no {result['backend']} devices: {result['error']}")
    return result["backend"], [device_info_from_dict(d) for d in result["devices"]]


def start_sandbox(cfg: BrokerConfig, backend: str) -> WorkerSandbox:
    """The workers' sandbox, proven to work here (FailedPrecondition naming what failed), or loudly off."""
    sandbox = WorkerSandbox.from_config(cfg, backend)
    sandbox.check_cache_root()
    if not cfg.sandbox:
        log.warning("the worker sandbox is OFF (sandbox = false / --no-sandbox): every tenant's code runs with the "
                    "broker's own user and can read its config and keys, other tenants' memory and tokens; "
                    "per-tenant cache directories only")
        return sandbox
    try:
        sandbox.check()
    except SandboxUnavailable as exc:
        raise FailedPrecondition(str(exc)) from None
    return sandbox


def _keepalive_options() -> list[tuple[str, int]]:
    # (this gRPC waits grpc.http2.ping_timeout_ms for a keepalive ping's answer; older ones keepalive_timeout_ms)
    return [("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS), ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.http2.ping_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_ping_interval_without_data_ms", MIN_CLIENT_PING_INTERVAL_MS)]


def _milliseconds(seconds: float) -> int:
    return max(1, min(2**31 - 1, int(seconds * 1000)))


# Descriptors one gRPC connection takes in the broker: the client's socket and the gate's socket to gRPC (both the
# gate's), and gRPC's end of that.
DESCRIPTORS_PER_CONNECTION = 3


def grpc_connection_cap(configured: int) -> int:
    """``max_grpc_connections``, held to half the broker's descriptor limit: however many connections a flood
    opens, the other half stays for the workers' pipes and sockets, the links and shared memory (the gate backs
    off when accept fails, but a worker that cannot start fails its tenant's session)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or configured * DESCRIPTORS_PER_CONNECTION <= soft // 2:
        return configured
    cap = max(1, soft // 2 // DESCRIPTORS_PER_CONNECTION)
    log.warning("max_grpc_connections = %d, but the broker may open only %d descriptors (%d for each gRPC "
                "connection): at most %d gRPC connections are kept (raise LimitNOFILE / ulimit -n for more)",
                configured, soft, DESCRIPTORS_PER_CONNECTION, cap)
    return cap


class Broker:
    """The front: one grpc.aio server, its sessions and its worker pool."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.server: grpc.aio.Server | None = None
        self.sessions: SessionManager | None = None
        self.pool: WorkerPool | None = None
        self.ports: list[str] = []
        self.schedulers: dict[int, DeviceScheduler] = {}
        self.links: LinkServer | None = None
        self.service: GpuBrokerService | None = None
        self.health: BrokerHealth | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._kills: set[asyncio.Task[None]] = set()
        self.metrics: MetricsServer | None = None
        self.sandbox: WorkerSandbox | None = None
        self.gate: GrpcGate | None = None
        self.accepts: AcceptorProcess | None = None  # the acceptor process every listener accepts in
        self._removing = asyncio.Lock()  # deletions of stale compile caches, one at a time
        self._removals: set[asyncio.Task[None]] = set()
        self.cpu_watch: CpuWatch | None = None
        self.memory_watch: MemoryWatch | None = None
        self._units: dict[int, int] = {}  # by device: its compute units (a CPU device's share of the host)
        self._ncpu = 1

    async def start(self) -> None:
        cfg = self.config
        # Listener credentials first: a TLS or plaintext misconfiguration fails before the slow device probe.
        tcp_creds, link_tls = check_listeners(cfg)
        unix_paths = [path for path in map(unix_path, cfg.listen) if path is not None]
        backend, devices = await asyncio.to_thread(probe_devices, cfg.backend)
        if cfg.devices is not None:
            missing = [d for d in cfg.devices if d >= len(devices)]
            if missing:
                raise FailedPrecondition(f"configured devices {missing} do not exist ({len(devices)} found)")
            devices = [devices[d] for d in cfg.devices]
        if not devices:
            raise FailedPrecondition(f"the {backend} backend found no devices")
        log.info("backend %s: %s", backend, ", ".join(f"{i}: {d.name} ({backend} device {d.id})"
                                                      for i, d in enumerate(devices)))
        self.sandbox = sandbox = await asyncio.to_thread(start_sandbox, cfg, backend)
        # Each tenant's compile cache is its name's and its token's (sandbox.cache_key): whatever a tenant left in
        # its cache is never found by a tenant added under its name later, even with the broker down meanwhile.
        sandbox.tenant_key = self._cache_key
        # With worker_memory_max = 0, each worker's memory limit follows its tenant's quotas (sandbox/_policy.py).
        sandbox.tenant_quota, sandbox.tenant_shared = self._memory_quota, self._shared_quota
        self.health = BrokerHealth(cfg, devices)  # (NVML maps the backend's own indices, the ids here)
        # Worker deaths are charged to their cause (workers/_pool.py): the tenant's crash budget, or (only for
        # failures no tenant caused) the device's health. A worker's reply is at most a copy chunk and envelope.
        self.pool = WorkerPool(backend, cfg.worker_start_timeout, cfg.worker_idle_seconds,
                               on_worker_exit=self._worker_exited, ordinals=[d.id for d in devices],
                               crash_budget=cfg.tenant_crash_budget, crash_window=cfg.tenant_crash_window_seconds,
                               on_failure=self.health.worker_exited, max_reply_bytes=cfg.max_message_bytes + (1 << 20),
                               sandbox=self.sandbox, send_buffer_bytes=cfg.worker_send_buffer_bytes,
                               write_stall_seconds=cfg.worker_write_stall_seconds)
        if sandbox.enabled and cfg.worker_zygote:
            # Sandboxed workers start as forks of a process that has loaded their code (workers/_zygote.py); it
            # loads in the background, and a start meanwhile waits for it.
            self.pool.zygote = Zygote(backend, sandbox.zygote_environment())
            self.pool.zygote.start()
        # Clients number the devices as this broker serves them: 0, 1, ... in the config's order.
        devices = [dataclasses.replace(d, id=i) for i, d in enumerate(devices)]
        self.sessions = SessionManager(cfg, self.pool, self.health, devices)
        # On a CPU device (OpenCL here means PoCL's) the device is the host's CPUs: a hold's device time is what
        # the holder's worker consumed of them (workers/_cpu.py), so a tenant slowed by others' CPU use is neither
        # timed out nor charged for it. On a GPU, a hold's wall time is its device time (the device is the
        # holder's alone), and the fence's figure its charge. An idle holder is fenced and gives the device up an
        # accounting period in (fence_idle): the time it counts as holding ends with its work (the CPU watch).
        cpu_device = backend == "opencl"
        self._ncpu = cpu_count()
        self._units = {d: max(1, min(info.multiprocessor_count, self._ncpu)) for d, info in enumerate(devices)}
        self.schedulers = {
            d: DeviceScheduler(functools.partial(self._fence, d), quantum=cfg.quantum_ms / 1000,
                               enabled=cfg.fair_scheduling, max_hold=cfg.max_kernel_seconds,
                               lone_hold=cfg.lone_kernel_seconds, on_overrun=functools.partial(self._overrun, d),
                               hold_meter=functools.partial(self._hold_meter, d) if cpu_device else None,
                               fence_idle=True)
            for d in range(len(devices))}
        # CPU the workers use outside their turns: while holding, a CPU device's worker may use all its compute
        # units and a GPU's one CPU; on the fair clock, a device second is that many CPU-seconds (a GPU's: the
        # host's CPUs, which such CPU is taken from).
        self.cpu_watch = CpuWatch(
            self.pool, self.schedulers,
            hold_cpus={d: float(u) if cpu_device else 1.0 for d, u in self._units.items()},
            charge_cpus={d: float(u) if cpu_device else float(self._ncpu) for d, u in self._units.items()},
            limit=cfg.max_cpu_seconds_outside_turns, window=cfg.cpu_outside_turns_window_seconds,
            kill=self._kill_for, charge_host_work=frozenset(self._units) if cpu_device else frozenset(),
            # (where the kernel does not hold the workers to worker_pids_max, the watch's count is all there is)
            threads_max=cfg.worker_pids_max if not sandbox.pids_enforced else 0)
        # On CUDA, what each worker holds on the devices, read from NVML (front/_memwatch.py): the quota's bound
        # from outside the worker, whose own accounting its tenant's native code can overwrite.
        self.memory_watch = await asyncio.to_thread(MemoryWatch.open, cfg, backend, self.pool.ordinals or [],
                                                    self.pool, self._kill_for)
        describe_bound(cfg, backend, self.memory_watch)
        self._apply_weights()
        self.auth = Authenticator(cfg)
        self.service = service = GpuBrokerService(cfg, self.auth, self.sessions, devices, self.schedulers,
                                                     sandbox.description)
        self.server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.so_reuseport", 0),
            # Before authentication: a connection that has not finished its HTTP/2 (and TLS) handshake within
            # the hello timeout is dropped, so idle unauthenticated connections cannot pile up (gRPC's default
            # is two minutes).
            ("grpc.server_handshake_timeout_ms", max(1, int(cfg.hello_timeout_seconds * 1000))),
            # After it: a connection that sent the HTTP/2 preface and SETTINGS is past the handshake, so on its
            # own it would stay open for good. gRPC closes one with no call in flight after grpc_idle_seconds and
            # lets each open at most max_grpc_streams_per_connection calls; the calls themselves are limited per
            # session and tenant. (How many connections there are, in all and per peer, the gate decides as it
            # accepts them: _grpc_peers.py. gRPC's own cap would count the gate's connections, which close a
            # moment before gRPC sees them go.)
            ("grpc.max_connection_idle_ms", _milliseconds(cfg.grpc_idle_seconds)),
            ("grpc.max_concurrent_streams", cfg.max_grpc_streams_per_connection),
            *_keepalive_options(),
            # No BDP probing: with it, gRPC widens every stream's flow-control window of a busy connection to
            # its bandwidth-delay estimate (measured: whole 4 MiB messages), so a call buffers that much of its
            # message in the front before any handler reads it, unauthenticated or stalled. Without, a call
            # holds at most its window (HTTP/2's 64 KiB) of a message nobody is reading; a read in progress
            # still gets the whole message at once (gRPC opens the window to the size its header announces).
            # The price: over a slow network a client's stream of large requests waits a round trip per message
            # (through a 4 ms round-trip proxy, 1 MiB messages: 115 MB/s, against 300-450 with BDP probing);
            # remote clients' copies take the TCP link (link_listen), whose flow control is the front's own.
            ("grpc.http2.bdp_probe", 0),
            # No compressed requests: gRPC inflates a message in the front before any handler sees it, and
            # max_message_bytes bounds what it inflates to, not what came in: 4 KiB of gzip became a 4 MiB request,
            # and two local uids sending such health checks (no token needed) under the call rate took the front
            # from 0.1 to over 1 CPU and alice's p50 from 0.9 to 15-29 ms. Identity only (the SDK compresses
            # nothing; its links compress on the tenant's worker, lz4): a compressed message is refused unread.
            ("grpc.compression_enabled_algorithms_bitset", 1),
        ])
        # Requests whose bytes do not parse get INVALID_ARGUMENT (gRPC's own answer would be UNKNOWN).
        add_servicer(pb_grpc.add_GpuBrokerServicer_to_server, service, self.server)
        admin = AdminService(self.auth, self.sessions, self.reload, self.schedulers, drain=self.drain,
                             undrain=self.undrain, health=self.health, devices=devices, sandbox=sandbox.description)
        add_servicer(apb_grpc.add_AdminServicer_to_server, admin, self.server)
        self.health.add_to_server(self.server)  # grpc.health.v1 and reflection, both without a token
        await self.health.start()
        # One count of unauthenticated connections across every raw listener (.fast of each socket, vsock, TCP).
        gate = PreAuthGate(cfg)
        if not PASSRIGHTS_SUPPORTED:
            log.warning("this kernel cannot refuse descriptors on a Unix socket (SO_PASSRIGHTS, Linux >= 6.16): a "
                        "peer of the broker's sockets may send one whose last close stalls the front; run a newer "
                        "kernel")
        # gRPC listens only on Unix sockets of the broker's own; the gate accepts on the listen addresses, caps
        # connections in all and per peer as it accepts them, and relays each to gRPC (_grpc_peers.py).
        # How fast each peer may connect (every listener together: a peer is one peer whichever it connects to)
        # and start gRPC calls; past either, closed at once (listeners.PeerRate).
        connection_rate = PeerRate(cfg.max_connections_per_peer_per_second, cfg.connection_burst_per_peer,
                                   self.health.refusals)
        call_rate = PeerRate(cfg.max_grpc_calls_per_peer_per_second, cfg.grpc_call_burst_per_peer,
                             self.health.refusals, reason="call rate")
        # and send HTTP/2 frames that start no call (ControlFrames), all of which gRPC parses on the front's loop.
        control_rate = PeerRate(cfg.max_grpc_control_frames_per_peer_per_second,
                                cfg.grpc_control_frame_burst_per_peer)
        # Every listener accepts in the front's acceptor process, which applies the connection rate and closes what
        # it refuses: a peer connecting and closing in a loop costs this loop nothing (_acceptor.py).
        self.accepts = AcceptorProcess(connection_rate, PeerNetworks(cfg.peer_network_ipv4, cfg.peer_network_ipv6))
        await self.accepts.start()
        self.gate = GrpcGate(grpc_connection_cap(cfg.max_grpc_connections), cfg.max_grpc_connections_per_peer,
                             self.health.refusals, connection_rate=connection_rate, call_rate=call_rate,
                             accepts=self.accepts, unauthenticated_seconds=cfg.grpc_unauthenticated_seconds,
                             control_rate=control_rate, max_per_tenant=cfg.max_grpc_connections_per_tenant)
        for address in cfg.listen:
            if (listen_path := unix_path(address)) is not None:
                public = self.gate.listen_unix(Path(listen_path), cfg.socket_mode, cfg.socket_group)
                # Local credentials: the only way gRPC lets call credentials (the bearer token) ride a socket.
                credentials = grpc.local_server_credentials(grpc.LocalConnectionType.UDS)
            else:
                # Loopback without TLS: local credentials, whose check (a loopback peer) is the gate's, since
                # gRPC sees a Unix socket; TLS (or insecure plaintext) passes through the gate untouched.
                local = cfg.tls is None and loopback_address(address)
                public = self.gate.listen_tcp(address, loopback_only=local)
                credentials = (grpc.local_server_credentials(grpc.LocalConnectionType.UDS) if local
                               else tcp_creds[address])
            self.server.add_secure_port(self.gate.private_address(public), credentials)
            self.ports.append(public)
        if cfg.vsock_port:
            # VM guests (`gpubroker relay` connects out over vsock): the gate accepts them too, each guest a peer
            # of its own (its CID) held to every per-peer cap and rate, and relays them to the first Unix
            # listener's gRPC socket, whose local credentials carry the bearer token as for a local client.
            behind = f"unix:{Path(unix_paths[0])}"
            self.gate.listen_vsock(listen_vsock(cfg.vsock_port), cfg.vsock_port, behind)
            log.info("relaying vsock port %d to unix:%s", cfg.vsock_port, unix_paths[0])
        await self.server.start()
        self.gate.start()
        # The framed link: the front authenticates its hello, then the session's worker serves it (_links.py); on
        # "<socket>.fast" beside each Unix socket a hello may ask for shared-memory segments instead, which the
        # front registers itself (_segments.py). With fast_path = false that socket serves segments only.
        segments = SegmentService(cfg, self.auth, self.sessions)
        self.links = LinkServer(service, gate, segments, cfg.max_links_per_tenant, cfg.link_handoff_timeout_seconds,
                                connection_rate, self.accepts)
        for address in self.ports:
            if (public_path := unix_path(address)) is not None:
                secure_unix_socket(Path(public_path), cfg.socket_mode, cfg.socket_group)
                path = Path(fast_path_address(public_path))
                try:
                    # No descriptors until a connection's hello authenticates it (_descriptors.py).
                    sock = listen_unix(path, cfg.socket_mode, cfg.socket_group, passrights=False)
                except OSError as exc:  # a path too long for AF_UNIX, say
                    if cfg.fast_path:
                        raise
                    log.warning("no shared-memory socket at %s: %s", path, exc)  # (copies go as commands)
                    continue
                self.links.listen_socket(sock, str(path), path, links=cfg.fast_path)
        if cfg.link_listen:
            link = parse_host_port(cfg.link_listen)
            host, port = link.host, link.port
            relays = None
            if link_tls is not None and cfg.link_tls_processes != 0:
                relays = TlsRelays(link_tls.material, cfg.link_tls_processes if cfg.link_tls_processes > 0 else None)
            service.link_port = await self.links.listen_tcp(
                host, port, link_tls.context if link_tls is not None else None, relays)
            log.info("serving links on %s:%d (%s)", host, service.link_port,
                     "TLS" if link_tls is not None else "plaintext")
        if cfg.link_vsock_port:
            self.links.listen_socket(listen_vsock(cfg.link_vsock_port), f"vsock:{cfg.link_vsock_port}")
            service.link_vsock_port = cfg.link_vsock_port
        if cfg.metrics_listen:
            collector = BrokerCollector(self.sessions, self.schedulers, self.pool, self.health.refusals, devices,
                                        self.health.problem, self.auth.failures)
            self.metrics = await serve_metrics(
                cfg.metrics_listen, collector,
                MetricsLimits(cfg.max_metrics_connections, cfg.max_metrics_connections_per_peer,
                              cfg.metrics_request_timeout_seconds, cfg.metrics_refresh_seconds,
                              cfg.metrics_requests_per_peer_per_second), connection_rate, self.accepts,
                ready=self.health.not_ready)
        self.sessions.start()
        self.cpu_watch.start()
        if self.memory_watch is not None:
            self.memory_watch.start()
        log.info("serving on %s", ", ".join(self.ports))

    def _worker_exited(self, worker: WorkerClient) -> None:
        if self.sessions is not None:
            self.sessions.worker_exited(worker)
        if worker.cache_dir is not None and worker.cache_dir.name != self._cache_key(worker.tenant):
            # It wrote to a cache its tenant no longer owns (removed, or its token rotated): delete it now.
            self._spawn_removal({worker.cache_dir})

    def _cache_key(self, tenant: str) -> str:
        """The key of the tenant's compile cache now (sandbox.cache_key of its token); a tenant that is not in the
        config gets one that nothing keeps (its worker's cache is deleted when it exits)."""
        t = self.config.tenants.get(tenant)
        return cache_key(t.token_hash) if t is not None else "removed"

    def _memory_quota(self, tenant: str, device: int) -> int:
        """The tenant's device memory quota on ``device`` now (0 for a tenant no longer in the config)."""
        t = self.config.tenants.get(tenant)
        return t.quota_on(device) if t is not None else 0

    def _shared_quota(self, tenant: str) -> int:
        """The host memory the tenant's sessions may map as shared-memory segments now (0 for a removed tenant)."""
        return self.config.shared_limit(tenant)[0] if tenant in self.config.tenants else 0

    def _spawn_removal(self, paths: set[Path]) -> None:
        task = asyncio.get_running_loop().create_task(self._remove_caches(paths))
        self._removals.add(task)
        task.add_done_callback(self._removals.discard)

    async def _remove_caches(self, paths: set[Path]) -> None:
        """Delete these compile caches, but those a running worker writes to (each is deleted when its worker
        exits: ``_worker_exited``)."""
        if self.sandbox is None:
            return
        async with self._removing:
            in_use = {w.cache_dir for w in self.pool.workers()} if self.pool is not None else set()
            try:
                removed = await asyncio.to_thread(self.sandbox.remove_caches, paths - in_use)
            except Exception:  # (never the broker's end: a cache left behind is found by nobody)
                log.exception("deleting stale compile caches failed")
                return
        for path in removed:
            log.info("deleted compile cache %s (its tenant was removed or its token rotated)", path)

    def _overrun(self, device: int, tenant: str, message: str) -> None:
        """The tenant's device work overran the kernel time limit: kill its worker (its calls get ``message``)."""
        worker = self.pool.live(tenant, device) if self.pool is not None else None
        if worker is not None:
            self._kill_for(worker, DeadlineExceeded(message))

    def _kill_for(self, worker: WorkerClient, fault: GpuBrokerError) -> None:
        """Kill a worker for its tenant's doing; its calls fail with ``fault``, its death is its tenant's failure."""
        if self.pool is None or not worker.alive:
            return
        task = asyncio.get_running_loop().create_task(self.pool.restart(worker, fault))
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)

    def _hold_meter(self, device: int, tenant: str) -> Callable[[], Metered] | None:
        """Start measuring the device seconds the tenant's worker consumes of a CPU device (workers/_cpu.py)."""
        worker = self.pool.live(tenant, device) if self.pool is not None else None
        cpu = worker.cpu if worker is not None else None
        if worker is None or cpu is None:
            return None
        units, ncpu, slowdown = self._units[device], self._ncpu, self.config.max_kernel_slowdown
        try:
            last = cpu.read(time.monotonic())
        except OSError:
            return None
        first, total = last, 0.0

        def consumed() -> Metered:
            # Summed reading by reading: the scheduler takes differences of this figure (from when others began
            # waiting), and each stretch between readings is held to max_kernel_slowdown on its own.
            nonlocal last, total
            if worker.alive:  # (once it is gone, what it consumed until its last reading)
                with contextlib.suppress(OSError):
                    reading = cpu.read(time.monotonic())
                    total += hold_seconds(last, reading, units, ncpu, slowdown)
                    last = reading
            return Metered(total, max(0.0, last.cpu - first.cpu) / max(1, units))

        return consumed

    async def drain(self, grace: float | None) -> float | None:
        """Refuse new sessions from now on (health NOT_SERVING); with a grace, end the sessions left after it.

        Returns the seconds until they are ended (None: no deadline). The broker stays up; SIGTERM stops it.
        """
        assert self.sessions is not None and self.health is not None
        if not self.health.draining:
            log.warning("draining: new sessions are refused, %d running%s", len(self.sessions.sessions),
                        "" if grace is None else f", ended after {grace:g} s if still running")
        self.sessions.draining = True
        if self.pool is not None:
            self.pool.draining = True  # stop signals to workers from now on are the operator's, not failures
        before = self.health.drain_deadline
        await self.health.drain(None if grace is None else time.monotonic() + grace)
        deadline = self.health.drain_deadline
        if deadline is None:
            return None
        if deadline != before:  # a first or shorter grace: (re)arm the end of the drain
            if self._drain_task is not None:
                self._drain_task.cancel()
            self._drain_task = asyncio.create_task(self._end_sessions_at(deadline), name="drain")
        return max(0.0, deadline - time.monotonic())

    async def undrain(self) -> bool:
        """End a drain: new sessions are taken again and a grace not yet over ends nobody. Whether it was draining."""
        assert self.sessions is not None and self.health is not None
        if self._drain_task is not None:
            self._drain_task.cancel()
            self._drain_task = None
        self.sessions.draining = False
        if self.pool is not None:
            self.pool.draining = False
        was = await self.health.undrain()
        if was:
            log.warning("drain ended: new sessions are taken again, %d running", len(self.sessions.sessions))
        return was

    async def _end_sessions_at(self, deadline: float) -> None:
        assert self.sessions is not None
        try:
            await asyncio.wait_for(self.sessions.idle.wait(), max(0.0, deadline - time.monotonic()))
            return
        except TimeoutError:
            pass
        left = list(self.sessions.sessions.values())
        log.warning("drain grace over: ending %d sessions still running", len(left))
        closing: dict[asyncio.Task[None], Session] = {}
        for session in left:  # (each closed by its worker in a task of its own: none waits for another's)
            task = self.sessions.end(session, reason="ended: the broker drained")
            if task is not None:
                closing[task] = session
        if not closing:
            return
        # A worker busy in its tenant's long operation answers the close only after it (a lone tenant may have no
        # time limit): past a margin it is killed, as the broker's stop would. Nobody's failure: the operator's.
        _, stuck = await asyncio.wait(closing, timeout=_CLOSE_MARGIN)
        assert self.pool is not None
        for task in stuck:
            session = closing[task]
            log.warning("drain: the worker of tenant %r on device %d did not close session %s within %g s: killed",
                        session.tenant, session.device, session.id, _CLOSE_MARGIN)
            self.pool.retire(session.worker, Unavailable("the broker drained: this session's worker was ended"))

    async def drain_and_wait(self, grace: float, until: asyncio.Event | None = None) -> None:
        """Drain, then wait until every session has closed or the grace is over (or ``until`` is set)."""
        assert self.sessions is not None and self.health is not None
        await self.drain(grace)
        waits = [asyncio.ensure_future(self.sessions.idle.wait())]
        if until is not None:
            waits.append(asyncio.ensure_future(until.wait()))
        deadline = self.health.drain_deadline
        # At the deadline the drain task ends the sessions left; allow their closing a moment, then stop anyway.
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic()) + _CLOSE_MARGIN
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()

    async def _fence(self, device: int, tenant: str) -> float:
        """Wait for the tenant's queued work on the device and return the device seconds it used."""
        worker = self.pool.live(tenant, device) if self.pool is not None else None
        if worker is None:  # (the scheduler charges the hold all the same)
            raise Unavailable(f"tenant {tenant}'s worker on device {device} is gone")
        return await worker.take_device_time()  # checked: finite, >= 0, within the wall time

    def _apply_weights(self) -> None:
        for scheduler in self.schedulers.values():
            for tenant in self.config.tenants.values():
                scheduler.set_weight(tenant.name, tenant.weight)

    async def reload(self) -> apb.ReloadResponse:
        """Re-read the tenants from the config file; live sessions of kept tenants go on."""
        if self.config.path is None or self.sessions is None:
            return apb.ReloadResponse()
        fresh = await asyncio.to_thread(load_config, self.config.path)
        old, new = self.config.tenants, fresh.tenants
        added = sorted(set(new) - set(old))
        removed = sorted(set(old) - set(new))
        changed = sorted(n for n in set(old) & set(new) if old[n] != new[n])
        # Swap in place: the service, sessions and authenticator all hold this config object. The authenticator's
        # reload also closes, at once, every stream and connection that a rotated or removed token opened, and kills
        # every worker that ran anything for it (_retire.py: their sessions end, saying why; a removed tenant's
        # sessions are closed below).
        self.config.tenants = new
        self.auth.reload(self.config)
        self._apply_weights()
        # Nothing below waits in line for a tenant's worker (its tenant's kernel may keep it from answering for as
        # long as it likes): the limits go to every worker at once, a removed tenant's workers are killed.
        limits = self.pool.apply_limits() if self.pool is not None else []  # quotas are the workers' to enforce
        ended = sum(self.sessions.end_tenant(name, reason="ended: tenant removed") for name in removed)
        if self.sandbox is not None:
            # The caches of the removed tenants (their workers are killed; each deletes its cache again as it exits)
            # and of rotated tokens (once no worker writes to them): no tenant ever finds them again, and their disk
            # is free.
            await self._remove_caches({self.sandbox.cache_path(n, cache_key(old[n].token_hash)) for n in old
                                       if n not in new or new[n].token_hash != old[n].token_hash})
        if limits:
            # The answer waits a moment for the workers that answer: their new limits hold when it comes. One that
            # does not answer takes them when it next reads (before anything the front sends it later).
            await asyncio.wait(limits, timeout=_LIMITS_WAIT)
        audit.info("action=reload added=%s removed=%s changed=%s sessions_ended=%d", added, removed, changed, ended)
        return apb.ReloadResponse(added=added, removed=removed, changed=changed, sessions_ended=ended)

    async def stop(self, grace: float = 5.0) -> None:
        if self._drain_task is not None:
            self._drain_task.cancel()
        if self.links is not None:
            await self.links.stop()
        if self.gate is not None:
            await self.gate.close_listeners()  # no new connections; those open get gRPC's grace
        if self.server is not None:
            await self.server.stop(grace)
        if self.gate is not None:
            await self.gate.stop()
        if self.cpu_watch is not None:
            await self.cpu_watch.stop()
        if self.memory_watch is not None:
            await self.memory_watch.stop()
        # Bounded: a worker held in its tenant's kernel never answers its sessions' closes, nor reads its channel's
        # end. The sessions' closes and the workers' exits share one grace; past it, the pool's close kills what is
        # left (each worker gets a moment after its channel's end at least).
        deadline = time.monotonic() + grace
        if self.sessions is not None:
            await self.sessions.stop(grace)
        if self.pool is not None:
            await self.pool.close(max(_WORKER_EXIT_SECONDS, deadline - time.monotonic()))
            if self.pool.zygote is not None:  # (after the workers: its launchers die with it)
                await self.pool.zygote.stop()
        if self._removals:  # (caches of workers that just exited)
            await asyncio.gather(*self._removals, return_exceptions=True)
        if self.health is not None:
            await self.health.stop()
        if self.metrics is not None:  # last: a scrape during the stop still sees the sessions go
            await self.metrics.stop()
        if self.accepts is not None:  # (every listener closed by now)
            await self.accepts.close()


async def _serve(config: BrokerConfig, ready_file: str | None) -> None:
    if ready_file:
        # A previous run's file would tell whoever waits for it that this broker is ready before it is (or when it
        # never will be): gone before anything else, and again when this broker stops.
        Path(ready_file).unlink(missing_ok=True)
    try:
        await _serve_ready(config, ready_file)
    finally:
        if ready_file:
            Path(ready_file).unlink(missing_ok=True)


async def _serve_ready(config: BrokerConfig, ready_file: str | None) -> None:
    broker = Broker(config)
    await broker.start()
    if ready_file:
        # Written whole, then renamed: whoever waits for the file never reads half of it.
        tmp = Path(ready_file + ".tmp")
        ready: dict[str, object] = {"ports": broker.ports, "pid": os.getpid()}
        if broker.metrics is not None:
            ready["metrics"] = broker.metrics.address
        if broker.service is not None and broker.service.link_port:
            ready["link_port"] = broker.service.link_port
        tmp.write_text(json.dumps(ready))
        tmp.replace(ready_file)
    if not json_logging():  # (with JSON lines, the log's "serving on" line says it: stderr is all JSON)
        print(f"gpubroker: serving on {', '.join(broker.ports)}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloads: set[asyncio.Task[None]] = set()

    async def reload_logged() -> None:
        try:
            await broker.reload()
        except Exception as exc:  # a broken config must not take the broker down; keep the old tenants
            log.error("reload on SIGHUP failed, keeping the current tenants: %s", exc)

    def on_sighup() -> None:
        task = loop.create_task(reload_logged())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    loop.add_signal_handler(signal.SIGHUP, on_sighup)
    # Ready for systemd (Type=notify) only once the signal handlers are in: its SIGTERM may follow at once.
    _systemd.notify("READY=1", f"STATUS=serving on {', '.join(broker.ports)}")
    watchdog = _systemd.start_watchdog()
    await stop.wait()
    log.info("stopping")
    _systemd.notify("STOPPING=1")
    # Drain first: new sessions are refused while running ones finish, for up to drain_grace_seconds.
    stop.clear()  # a second SIGTERM or SIGINT cuts the drain short
    await broker.drain_and_wait(config.drain_grace_seconds, until=stop)
    await broker.stop()
    if watchdog is not None:  # pinged through the whole stop, which may outlast WatchdogSec
        watchdog.cancel()


# glibc's M_MMAP_THRESHOLD, and the size above which the front's allocations are mapped apart from its heap.
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 128 * 1024


def _large_frees_go_back_to_the_os() -> None:
    """Fix glibc's mmap threshold at its default (128 KiB), so that a large buffer freed goes back to the OS.

    glibc raises the threshold to the size of each mapped block freed (up to 32 MiB): after the first request of
    a few MiB, every later one comes from the heap, and the heap keeps what it had at its peak. Requests a tenant
    sends and gives up on (to a worker that is not reading, say) then leave the front hundreds of MiB larger
    for good, although what it holds is bounded; with the threshold fixed, what it holds is what it uses. (A
    few page faults per large buffer is the price; other C libraries: nothing to do.)
    """
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)


def run_broker(config: BrokerConfig, ready_file: str | None = None) -> None:
    """Serve until SIGTERM or SIGINT, on uvloop where it is installed."""
    _large_frees_go_back_to_the_os()
    try:
        import uvloop
    except ImportError:
        uvloop = None  # type: ignore[assignment]  # the module or None, tested before use
    with contextlib.suppress(KeyboardInterrupt):
        if uvloop is not None:
            uvloop.run(_serve(config, ready_file))
        else:
            asyncio.run(_serve(config, ready_file))
