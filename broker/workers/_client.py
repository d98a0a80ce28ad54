"""The front's side of a worker: start the process, send requests, and notice when it dies."""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from gpubroker.client import (
    DeviceInfo,
    FailedPrecondition,
    GpuBrokerError,
    ResourceExhausted,
    Unavailable,
    WorkerCrashed,
)
from gpubroker.client._errors import error_from_wire

from ..sandbox import Launch, WorkerSandbox
from ._direct import CONTROL
from ._frames import FrameClosed, read_frame_async, write_frame_async

__all__ = ["WorkerClient", "device_info_from_dict"]

log = logging.getLogger("gpubroker.workers")


def device_info_from_dict(d: dict[str, Any]) -> DeviceInfo:
    d = dict(d)
    for key in ("max_block_dims", "max_grid_dims"):
        d[key] = tuple(d[key])
    if d.get("compute_capability") is not None:
        d["compute_capability"] = tuple(d["compute_capability"])
    return DeviceInfo(**d)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "its connection closed while it was still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == 3:
        return "exited after a fatal device error (its context was corrupted)"
    return f"exited with status {code}"


class WorkerClient:
    """One worker process for one (tenant, device); requests may overlap, replies match by id."""

    def __init__(self, tenant: str, device: int, backend: str,
                 on_exit: Callable[[WorkerClient], None] | None = None, ordinal: int | None = None,
                 sandbox: WorkerSandbox | None = None) -> None:
        self.tenant = tenant
        self.device = device  # the broker's index
        self.ordinal = device if ordinal is None else ordinal  # the backend's index of the same device
        self.backend = backend
        # Without one (a worker started outside a broker), the plain worker with its own cache directory.
        self.sandbox = sandbox if sandbox is not None else WorkerSandbox(enabled=False, backend=backend)
        self._launch: Launch | None = None
        self.oom_killed = False  # the kernel's OOM killer ended it in its cgroup (memory.max): its tenant's doing
        self.info: DeviceInfo | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.death: str | None = None
        self.last_used = time.monotonic()
        self._on_exit = on_exit
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._write_lock = asyncio.Lock()
        self._stopping = False
        # Lease messages from the worker (its direct client links want, or gave back, the tenant's turn).
        self.on_control: Callable[[str], None] | None = None
        self.on_death: list[Callable[[], None]] = []
        # Carries file descriptors (shared-memory segments) to the worker, apart from the request stream, whose
        # asyncio transport cannot send SCM_RIGHTS.
        self._fd_sock: socket.socket | None = None

    @property
    def alive(self) -> bool:
        return self.death is None and self.process is not None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    async def start(self, timeout: float) -> DeviceInfo:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._fd_sock, fd_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # Never block the event loop: a full fd channel fails that registration instead.
        self._fd_sock.setblocking(False)
        try:
            fds = [child.fileno(), fd_child.fileno()]
            argv = [sys.executable, "-m", "gpubroker.broker.workers", "--fd", str(child.fileno()),
                    "--fd-channel", str(fd_child.fileno()),
                    "--backend", self.backend, "--device", str(self.ordinal), "--tenant", self.tenant]
            # In the sandbox's launcher, which runs the worker as its child in namespaces of its own.
            self._launch = self.sandbox.prepare(self.tenant, self.device, argv, fds)
            try:
                # subprocess (vfork + exec) rather than the event loop's spawner: uvloop forks, and a forked
                # child of a process full of gRPC threads was seen to crash before it could exec.
                self.process = subprocess.Popen(self._launch.argv, env=self._launch.env, pass_fds=fds,
                                                stdin=subprocess.DEVNULL)
            except BaseException:
                await self._release()
                raise
        finally:
            child.close()
            fd_child.close()
        reader, self._writer = await asyncio.open_unix_connection(sock=parent, limit=1 << 20)
        try:
            _, status, result = await asyncio.wait_for(read_frame_async(reader), timeout)
        except (FrameClosed, TimeoutError) as exc:
            await self.kill()
            code = self.process.returncode
            raise Unavailable(f"worker for tenant {self.tenant!r} on device {self.device} failed to start "
                              f"({'timed out' if isinstance(exc, TimeoutError) else _describe_exit(code)})") from None
        if status != 0:
            await self.kill()
            raise error_from_wire(result["code"], result["message"], result.get("type"), result.get("details"))
        self.info = device_info_from_dict(result)
        self._reader_task = asyncio.create_task(self._read_replies(reader), name=f"worker-{self.tenant}-{self.device}")
        log.info("worker for tenant %s on device %d started (pid %d)", self.tenant, self.device, self.process.pid)
        return self.info

    async def call(self, op: str, session: str, **params: Any) -> Any:
        """Run one operation; raises the worker's error, or WorkerCrashed if it dies meanwhile."""
        return await self._call(op, session, params, None)

    async def call_with_fd(self, op: str, session: str, fd: int, **params: Any) -> Any:
        """Run ``op`` with ``fd`` passed on the fd channel; the worker receives it while serving ``op``.

        The fd goes out just before the request, under the same lock and with no await in between, so the
        worker (which reads the channel in request order) pairs them; a one-time token checks the pairing.
        """
        return await self._call(op, session, params, fd)

    async def _call(self, op: str, session: str, params: dict[str, Any], fd: int | None) -> Any:
        if self.death is not None:
            raise WorkerCrashed(self.death)
        if self._writer is None:
            raise FailedPrecondition("worker not started")
        self.last_used = time.monotonic()
        req_id = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        try:
            async with self._write_lock:
                if fd is not None:
                    params = {**params, "token": self._send_fd(fd)}
                await write_frame_async(self._writer, [req_id, op, session, params])
        except GpuBrokerError:  # the fd could not be passed; nothing was sent
            self._pending.pop(req_id, None)
            raise
        except (ConnectionError, OSError):
            self._pending.pop(req_id, None)
            await self._died()
            raise WorkerCrashed(self.death or "worker connection lost") from None
        try:
            return await fut
        finally:
            self._pending.pop(req_id, None)

    async def send_control(self, op: str) -> None:
        """A lease message to the worker ("grant" or "revoke"); no reply."""
        if self.death is not None or self._writer is None:
            raise WorkerCrashed(self.death or "worker not started")
        try:
            async with self._write_lock:
                await write_frame_async(self._writer, [CONTROL, op, "", None])
        except (ConnectionError, OSError):
            await self._died()
            raise WorkerCrashed(self.death or "worker connection lost") from None

    def _send_fd(self, fd: int) -> bytes:
        if self._fd_sock is None:
            raise FailedPrecondition("worker not started")
        token = secrets.token_bytes(16)
        try:
            socket.send_fds(self._fd_sock, [token], [fd])
        except BlockingIOError:
            raise ResourceExhausted("the worker's fd channel is full; retry") from None
        except ConnectionError:
            raise  # the worker is gone: the caller handles its death
        except OSError as exc:  # (ETOOMANYREFS, say) not the worker's fault: refuse this one, keep the worker
            raise Unavailable(f"could not pass the segment to the worker: {exc.strerror}") from None
        return token

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                req_id, status, result = await read_frame_async(reader)
                if req_id == CONTROL:
                    if self.on_control is not None:
                        self.on_control(status)
                    continue
                fut = self._pending.pop(req_id, None)
                if fut is None or fut.done():
                    continue  # the caller gave up (deadline, cancel); the reply is moot
                if status == 0:
                    fut.set_result(result)
                else:
                    fut.set_exception(error_from_wire(result["code"], result["message"], result.get("type"),
                                                      result.get("details")))
        except (FrameClosed, ConnectionError, OSError, ValueError):
            pass
        await self._died()

    async def _died(self) -> None:
        if self.death is not None:
            return
        code = None
        if self.process is not None:
            try:
                code = await self._wait(5.0)
            except TimeoutError:
                self.process.kill()
                code = await self._wait(None)
        await self._release()
        how = _describe_exit(code)
        if self.oom_killed:
            how += f" by the OOM killer (the worker memory limit, {self.sandbox.memory_max} bytes)"
        self.death = (f"the worker process for tenant {self.tenant!r} on device {self.device} "
                      f"(pid {self.pid}) {how}; this session's device state is lost, "
                      "open a new session")
        (log.info if self._stopping else log.error)("%s", self.death)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(WorkerCrashed(self.death))
        self._pending.clear()
        for callback in self.on_death:
            callback()
        if self._writer is not None:
            self._writer.close()
        if self._fd_sock is not None:
            self._fd_sock.close()
        if self._on_exit is not None:
            self._on_exit(self)

    async def stop(self, timeout: float = 10.0) -> None:
        """Ask the worker to exit by closing its socket; kill it if it lingers."""
        if self.process is None:
            return
        self._stopping = True
        if self._writer is not None and not self._writer.is_closing():
            self._writer.close()
        try:
            await self._wait(timeout)
        except TimeoutError:
            await self.kill()
        if self._reader_task is not None:
            try:
                await asyncio.wait_for(self._reader_task, timeout)
            except (TimeoutError, GpuBrokerError):
                pass

    async def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            await self._wait(None)
        if self._fd_sock is not None:
            self._fd_sock.close()  # (a worker that failed to start never reaches _died)
        if self.process is not None and self.process.returncode is not None:
            await self._release()

    async def _release(self) -> None:
        """Once the worker is gone: remove its cgroup (once), noting an OOM kill there."""
        launch, self._launch = self._launch, None
        if launch is not None and launch.cgroup is not None:
            self.oom_killed = await asyncio.to_thread(self.sandbox.release, launch) or self.oom_killed

    async def _wait(self, timeout: float | None) -> int:
        """The exit status, waited for off the event loop; TimeoutError if it outlives ``timeout``."""
        assert self.process is not None
        try:
            return await asyncio.to_thread(self.process.wait, timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError from None
