"""The front's side of a worker: start the process, send requests, and notice when it dies.

The front trusts nothing a worker says (see WorkerClient).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from msgspec import Raw

from gpubroker.broker.front._descriptors import set_passrights
from gpubroker.broker.front.workers._cpu import WorkerCpu
from gpubroker.broker.front.workers._output import WorkerOutput, escape
from gpubroker.broker.front.workers._replies import (
    WorkerLied,
    check_ack,
    decode_control,
    decode_error,
    decode_reply,
    device_info_from_dict,
    first_words,
)
from gpubroker.broker.front.workers._zygote import LauncherProcess, Zygote, ZygoteProcess
from gpubroker.broker.sandbox import EXIT_SETUP_FAILED, Launch, WorkerSandbox, python_argv
from gpubroker.wire.commands import Ack, Batch, Command, DeviceInfoQuery
from gpubroker.wire.errors import FailedPrecondition, GpuBrokerError, ResourceExhausted, Unavailable, WorkerCrashed
from gpubroker.wire.types import DeviceInfo
from gpubroker.wire.worker import (
    CONTROL,
    EXIT_FATAL,
    FRAME_HEADER,
    MAX_FRAME,
    FrameClosed,
    FrameRefused,
    FromWorker,
    Grant,
    LeaseToFront,
    LeaseToWorker,
    Released,
    RunBatch,
    TakeDeviceTime,
    ToWorker,
    Want,
    WorkerRequest,
    encode,
    read_reply,
)

__all__ = ["CONTROL", "DEFAULT_SEND_BUFFER", "DEFAULT_WRITE_STALL", "EXIT_FATAL", "WorkerClient",
           "device_info_from_dict"]

T = TypeVar("T")

log = logging.getLogger("gpubroker.workers")

# Replies to requests whose callers gave up are remembered (to tell them from replies to requests never made)
# up to this many; past it the oldest are forgotten, and a late reply to one of those counts as a lie.
_ABANDONED_MAX = 65536
# Fence charges may exceed the wall time since the last fence by this much (clock granularity, and the
# worker's timer starting a hair before the front's).
_CHARGE_SLACK = 0.05
# Once a worker has exited, how long its pipes may take to reach end-of-file: a process it started that is still
# alive (only where there is no sandbox, whose PID namespace ends with the worker) would hold them open forever.
_OUTPUT_CLOSE_SECONDS = 2.0
# The defaults of the config's worker_send_buffer_bytes and worker_write_stall_seconds (see there).
DEFAULT_SEND_BUFFER = 64 * 1024 * 1024
_FRAME_ALLOWANCE = 256
DEFAULT_WRITE_STALL = 300.0


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


def _lost(why: str) -> str:
    """What a call on a worker killed for a cause says: the cause, and what the tenant does next."""
    return f"{why}; this session's device state is lost, open a new session"


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "its connection closed while it was still running"
    if code < 0:
        try:
            return f"killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == EXIT_FATAL:
        return "exited after a fatal device error (its context was corrupted)"
    return f"exited with status {code}"


def _frame_size(message: msgspec.Struct) -> int:
    """About the bytes ``message`` encodes to, without encoding it: its bytes and strings (a batch, a module
    source) and an allowance for the rest of it (ids, names, numbers)."""
    return _FRAME_ALLOWANCE + sum(len(v) for v in msgspec.structs.astuple(message) if type(v) in (bytes, str))


class WorkerClient:
    """One worker process for one (tenant, device); requests may overlap, replies match by id.

    Trust: none. The tenant runs native code inside its worker (by design on CPU OpenCL, and assumed on every
    backend), so anything the worker writes on its socket may be forged. The front therefore

    - reads frames of at most ``max_reply_bytes`` (the largest honest reply: a copy chunk plus its envelope)
      and only the protocol's envelope (gpubroker/wire/worker.py ``FromWorker``), its body left encoded;
    - takes replies only to requests it made: an id it never issued, or one already answered, is a lie (replies
      to requests whose caller gave up are remembered and dropped);
    - decodes each result as the type its request returns (``WorkerRequest``'s type parameter) and nothing else,
      and checks it against the request (workers/_replies.py): a read returns exactly the bytes asked for, a batch
      error names one of the batch's commands, device info has every field of its type;
    - rebuilds errors only as gpubroker classes of a status a worker may report (never UNAUTHENTICATED or
      PERMISSION_DENIED, never an arbitrary class), message cut at 4 KiB, details bounded to short scalars;
    - decodes a batch's answer as an Ack and holds it to the batch (``check_ack``): its id, no more commands done
      than it held, an error only for one of them, a read's result exactly the bytes asked for;
    - takes memory use (fences, usage, lease releases) only as integers >= 0, and never past the highest quota
      it was sent (``memory_reported``: more is its accounting overwritten), and the front clamps it to the
      tenant's quota (the mirror only informs placement and views: the worker keeps the quota's accounts, and on
      CUDA the front's NVML watch, front/_memwatch.py, bounds what the worker holds from outside);
    - takes lease messages (``CONTROL``) only of the known kinds and in protocol order: one ``Want`` per grant the
      front sends, one ``Released`` per grant, which bounds their rate by the front's own grants;
    - takes fence charges (``take_device_time``) only finite and >= 0, and no more than the wall time since the
      worker's previous fence (cut to it), so a worker cannot make itself dearer, nor others cheaper, than the
      device was; making itself cheaper is bounded by the scheduler, which charges a holder at least the wall
      time it kept others waiting.

    What the front holds for a worker is bounded too: requests wait for room in the socket before they are written
    (a caller that gives up meanwhile leaves nothing behind), the bytes waiting toward one worker are capped
    (``send_buffer_bytes``: past it a call gets RESOURCE_EXHAUSTED), and a worker that reads none of them for
    ``write_stall_seconds`` while they wait is killed, its tenant's failure.

    A worker that breaks any of these is killed at once (its callers get ``WorkerCrashed`` saying why) and its
    death is its tenant's failure (workers/_pool.py): it counts against the tenant's crash budget, never
    against the device.
    """

    def __init__(self, tenant: str, device: int, backend: str,
                 on_exit: Callable[[WorkerClient], None] | None = None, ordinal: int | None = None,
                 sandbox: WorkerSandbox | None = None, max_reply_bytes: int = MAX_FRAME,
                 on_output_dropped: Callable[[int], None] | None = None, send_buffer_bytes: int = DEFAULT_SEND_BUFFER,
                 write_stall_seconds: float = DEFAULT_WRITE_STALL, zygote: Zygote | None = None) -> None:
        self.tenant = tenant
        self.device = device  # the broker's index
        self.ordinal = device if ordinal is None else ordinal  # the backend's index of the same device
        self.backend = backend
        # Without one (a worker started outside a broker), the plain worker with its own cache directory.
        self.sandbox = sandbox if sandbox is not None else WorkerSandbox(enabled=False, backend=backend)
        self._launch: Launch | None = None
        self.memory_max = 0  # the memory it may use, as its launch set it (sandbox/_policy.py worker_memory)
        self.cache_dir: Path | None = None  # the tenant's compile cache it writes to (kept while it runs)
        self.oom_killed = False  # the kernel's OOM killer ended it in its cgroup (memory.max): its tenant's doing
        self.info: DeviceInfo | None = None
        self.process: LauncherProcess | None = None
        # Where its launcher comes from: forked by the zygote when there is one (``forked``), else exec'd.
        self.zygote = zygote
        self._forked: ZygoteProcess | None = None
        # Its stdout and stderr: untrusted, read by the front and logged rate-limited and escaped as this tenant's.
        self.output = WorkerOutput(tenant, device, on_output_dropped)
        self.death: str | None = None
        self.last_used = time.monotonic()
        self._on_exit = on_exit
        self.max_reply_bytes = max_reply_bytes
        self._ids = itertools.count(1)
        self._last_id = 0
        # Each request's future, the request, and (a batch) the Batch its Ack is held to.
        self._pending: dict[int, tuple[asyncio.Future[Any], WorkerRequest[Any], Batch | None]] = {}
        self._abandoned: dict[int, None] = {}  # (ordered: the oldest is forgotten first)
        # Set when the front kills the worker for a cause (a time limit, a lie): its callers get this error,
        # and the death is its tenant's failure.
        self.fault: GpuBrokerError | None = None
        self.tenant_code_ran = False
        # Killed by the front because a credential it served was revoked, or its session's work was abandoned
        # (``retire``): nobody's failure.
        self.retired = False
        # Who the death is charged to, once decided by the pool: "tenant", "device" or None (a stop, a drain).
        self.blame: str | None = None
        self._dying: asyncio.Future[None] | None = None
        self._want_pending = False  # a lease Want not yet answered with a grant
        self._grants_out = 0  # grants sent and not yet given back
        self._last_take: float | None = None
        self._started = time.monotonic()
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task[None] | None = None
        self._write_lock = asyncio.Lock()
        # The requests' encoded bytes waiting for room toward the worker (not yet in its transport), their cap,
        # and since when the worker has read nothing while some waited (None: it keeps up).
        self.send_buffer_bytes = send_buffer_bytes
        self.write_stall_seconds = write_stall_seconds
        self._waiting_bytes = 0
        self._stalled_since: float | None = None
        self._stopping = False
        # Lease messages from the worker (its direct client links want, or gave back, the tenant's turn).
        self.on_control: Callable[[LeaseToFront], None] | None = None
        self.on_death: list[Callable[[], None]] = []
        # The worker's device memory use as it reports it (fences, usage, lease releases), checked >= 0.
        self.on_memory: Callable[[WorkerClient, int], None] | None = None
        # The highest device-memory quota the front has sent it (SetLimits; None: none yet). A worker reserves
        # within the quota it holds, so it never rightly reports more than this, whatever reloads lowered since;
        # the NVML watch (front/_memwatch.py) bounds its device memory by it too.
        self.memory_quota_max: int | None = None
        # Set when the front kills it for device memory: "nvml" (NVML counted more than its quota plus the
        # headroom on a device) or "report" (it reported more in use than its quota): the metrics count these.
        self.memory_kill: str | None = None
        # Its counters (launches, bytes h2d, d2h, d2d) as of its last ``usage`` report: the metrics add what each
        # report adds (its tenant's own figures, as its worker says: native code there could forge them).
        self.done_reported: tuple[int, int, int, int] = (0, 0, 0, 0)
        # Carries file descriptors (shared-memory segments) to the worker, apart from the request stream, whose
        # asyncio transport cannot send SCM_RIGHTS.
        self._fd_sock: socket.socket | None = None
        # The worker's process tree, for what it consumes of the host's CPUs (its tenant's limits and charges).
        self.cpu: WorkerCpu | None = None
        # Wall time with a request of the front's in flight (a compile uses a CPU outside the device turns).
        self._calls_in_flight = 0
        self._busy_since = 0.0
        self._busy_total = 0.0

    @property
    def alive(self) -> bool:
        return self.death is None and self.process is not None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def forked(self) -> bool:
        """Its launcher was forked by the zygote."""
        return self._forked is not None

    @property
    def lost_with_zygote(self) -> bool:
        """It died because the zygote that forked its launcher did (its launcher's parent-death signal): nobody's
        failure, neither its tenant's nor its device's."""
        return self._forked is not None and self._forked.orphaned

    @property
    def stopping(self) -> bool:
        """The front stopped this worker on purpose (idle, tenant removed, broker stopping)."""
        return self._stopping

    @property
    def returncode(self) -> int | None:
        return self.process.returncode if self.process is not None else None

    async def start(self, timeout: float) -> DeviceInfo:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._fd_sock, fd_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # The worker never sends the front a descriptor: its last close could stop the front (front/_descriptors.py).
        set_passrights(parent, False)
        set_passrights(self._fd_sock, False)
        # Never block the event loop: a full fd channel fails that registration instead.
        self._fd_sock.setblocking(False)
        try:
            fds = [child.fileno(), fd_child.fileno()]
            argv = [*python_argv(), "gpubroker.broker.worker", "--fd", str(child.fileno()),
                    "--fd-channel", str(fd_child.fileno()),
                    "--backend", self.backend, "--device", str(self.ordinal), "--tenant", self.tenant]
            # In the sandbox's launcher, which runs the worker as its child in namespaces of its own.
            self._launch = self.sandbox.prepare(self.tenant, self.device, argv, fds)
            self.cache_dir = self._launch.cache
            self.memory_max = self._launch.memory_max
            try:
                # subprocess (vfork + exec) rather than the event loop's spawner: uvloop forks, and a forked
                # child of a process full of gRPC threads was seen to crash before it could exec. Its output
                # comes to the front on pipes of its own, never onto the front's log as it is (workers/_output.py).
                # A session of its own: never the front's process group, which a worker's "my group" (kill(0),
                # setpriority(PRIO_PGRP, 0)) would otherwise reach (the sandbox's worker makes one of its own too).
                # The front ends workers by pid; a launcher dies with the front (PR_SET_PDEATHSIG), an unsandboxed
                # worker at its channel's end-of-file.
                self.process = await self._spawn(self._launch, [*fds, *self._launch.launcher_fds])
                self.cpu = WorkerCpu(self.process.pid, launcher=self.sandbox.enabled)
                self.output.pid = self.process.pid
                assert self.process.stdout is not None and self.process.stderr is not None
                await self.output.attach(self.process.stdout, self.process.stderr)
            except BaseException:
                if self.process is not None:
                    self.process.kill()
                    await self._wait(None)
                    self.output.close()
                await self._release()
                raise
        finally:
            child.close()
            fd_child.close()
            if self._launch is not None:
                self._launch.started()
        reader, self._writer = await asyncio.open_unix_connection(sock=parent, limit=1 << 20)
        try:
            first = await asyncio.wait_for(read_reply(reader, self.max_reply_bytes), timeout)
        except (FrameClosed, TimeoutError, FrameRefused, ValueError, TypeError) as exc:
            await self.kill()
            code = self.process.returncode
            how = "timed out" if isinstance(exc, TimeoutError) else _describe_exit(code)
            if code == EXIT_SETUP_FAILED and self.output.last_line:
                # The launcher's own message (no tenant code has run yet; escaped all the same).
                how += f": {self.output.last_line}"
            raise Unavailable(f"worker for tenant {self.tenant!r} on device {self.device} failed to start "
                              f"({how})") from None
        try:  # (a worker's start runs no tenant code, but its answer is checked all the same)
            words = first_words(first.status, first.body)
        except WorkerLied as exc:
            await self.kill()
            raise Unavailable(f"worker for tenant {self.tenant!r} on device {self.device} failed to start "
                              f"(it answered with {exc})") from None
        if isinstance(words, GpuBrokerError):
            await self.kill()
            raise words
        self.info = words
        self._reader_task = asyncio.create_task(self._read_replies(reader), name=f"worker-{self.tenant}-{self.device}")
        log.info("worker for tenant %s on device %d started (pid %d)", self.tenant, self.device, self.process.pid)
        return self.info

    async def _spawn(self, launch: Launch, pass_fds: list[int]) -> LauncherProcess:
        """The launcher: forked by the zygote (sandboxed, when it serves), or exec'd."""
        if self.zygote is not None and self.sandbox.enabled and await self.zygote.usable():
            try:
                self._forked = await self.zygote.spawn(launch.argv, pass_fds)
                return self._forked
            except OSError as exc:  # (this start is exec'd; the next too, unless the system only refused one fork)
                log.info("tenant %s's worker on device %d is started without the zygote: %s", self.tenant,
                         self.device, exc)
        return subprocess.Popen(launch.argv, env=launch.env, pass_fds=pass_fds, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)

    async def call(self, request: WorkerRequest[T], session: str = "", fd: int | Sequence[int] | None = None) -> T:
        """Run one request (in ``session``, for those of a session); its result, of the type the request returns.
        Raises the worker's error, or WorkerCrashed if it dies meanwhile.

        With ``fd`` (a request with a ``token`` field; or several, in one message), the fd is passed on the fd
        channel and the worker receives
        it while serving the request: it goes out just before the request, under the same lock and with no await in
        between, so the worker (which reads the channel in request order) pairs them; a one-time token checks the
        pairing.
        """
        result: T = await self._call(request, session, fd)
        return result

    async def run_batch(self, session: str, batch: Batch, encoded: bytes) -> Ack:
        """Run ``batch`` (``encoded`` is its encoding) in the session; its Ack, checked against it."""
        # A batch that only asks what the device is runs none of the tenant's code (the front's own, at a session's
        # opening): a death after it is still the device's.
        # (each command's class once: a pass at C speed over the batch's commands)
        kinds: set[type[Command]] = set(map(type, batch.commands))
        front = all(issubclass(kind, DeviceInfoQuery) for kind in kinds)
        # Only while a compile or a copy (``host_work``) is in flight may a worker use CPU outside its turns (the
        # CPU watch); a tenant that keeps cheap calls (allocations, frees) going does not earn its threads a CPU.
        host_work = any(kind.host_work for kind in kinds)
        ack: Ack = await self._call(RunBatch(encoded), session, None, batch=batch, front=front, host_work=host_work)
        return ack

    def death_error(self) -> GpuBrokerError:
        """What a call on the dead worker fails with: its fault's status (a time limit: DEADLINE_EXCEEDED), else
        WorkerCrashed; the message says why it died."""
        if self.fault is not None:  # (also while it is being killed for it: the death is not yet noticed)
            return type(self.fault)(self.death or _lost(self.fault.message), **self.fault.details)
        death = self.death or "the worker is gone"
        return WorkerCrashed(death)

    async def _call(self, request: WorkerRequest[Any], session: str, fd: int | Sequence[int] | None,
                    batch: Batch | None = None, front: bool = False, host_work: bool = True) -> Any:
        if self.death is not None:
            raise self.death_error()
        if self._writer is None:
            raise FailedPrecondition("worker not started")
        self.last_used = time.monotonic()
        if request.tenant_code and not front:
            self.tenant_code_ran = True
        req_id = self._last_id = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        # A caller cancelled in the very step its reply or the worker's death arrived never reads the outcome.
        fut.add_done_callback(_retrieve)
        self._pending[req_id] = (fut, request, batch)
        try:
            # (with an fd, its token is made under the lock, the fd sent just before the request: see call)
            # The front's own requests (limits, closing, accounting: not the tenant's code) are never refused for the
            # tenant's backlog: a reload's lower quota or a session's close must reach a worker whose tenant filled
            # worker_send_buffer_bytes (they are few and small: each waits for its reply).
            await self._send(ToWorker(req_id, session, request), fd, capped=request.tenant_code)
        except GpuBrokerError:  # the fd could not be passed, or no room: nothing was sent
            self._pending.pop(req_id, None)
            raise
        except (ConnectionError, OSError):
            self._pending.pop(req_id, None)
            await self._died()
            raise self.death_error() from None
        except BaseException:  # cancelled while waiting for room: its frame was never written
            self._pending.pop(req_id, None)
            raise
        busy = 1 if host_work else 0
        self._busy(busy)
        try:
            return await fut
        finally:
            self._busy(-busy)
            if self._pending.pop(req_id, None) is not None and self.death is None:
                self._abandon(req_id)  # the caller gave up: its reply, when it comes, is moot but honest

    def _busy(self, change: int) -> None:
        now = time.monotonic()
        if self._calls_in_flight > 0:
            self._busy_total += now - self._busy_since
        self._busy_since = now
        self._calls_in_flight += change

    def busy_seconds(self) -> float:
        """Wall seconds during which the worker had at least one of the front's requests to serve that works on the
        host's CPU (a compile, a copy: ``_HOST_WORK``; the front's own requests)."""
        if self._calls_in_flight > 0:
            return self._busy_total + time.monotonic() - self._busy_since
        return self._busy_total

    def _abandon(self, req_id: int) -> None:
        self._abandoned[req_id] = None
        if len(self._abandoned) > _ABANDONED_MAX:
            del self._abandoned[next(iter(self._abandoned))]

    async def take_device_time(self) -> float:
        """The device seconds the worker used since its last fence (it waits for its queued work first).

        A charge that is no number, not finite or negative is a lie: the worker is killed. One above the wall time
        since the worker's previous fence is cut to that wall time: commands on overlapping streams are each
        measured in full, but the device was never the tenant's for longer than that, so neither may it be
        charged more (which would make others look cheap beside it).
        """
        since = self._last_take if self._last_take is not None else self._started
        result = await self.call(TakeDeviceTime())
        now = time.monotonic()
        self._last_take = now
        seconds = result.seconds  # (the type has it a float >= 0, and the memory used a count)
        if not math.isfinite(seconds):
            self._lied(f"a device-time charge of {str(seconds)[:60]}")
            raise WorkerCrashed(self.death or "the worker was killed for a bad device-time charge")
        self.memory_reported(result.memory_used)
        wall = now - since + _CHARGE_SLACK
        if seconds > wall:
            log.info("tenant %s: a device-time charge of %.3f s over %.3f s of wall time, charged as the wall time",
                     self.tenant, seconds, wall)
            return wall
        return float(seconds)

    def memory_reported(self, used: int) -> None:
        """The worker's memory use, from any of its reports (decoded as a count >= 0).

        A report past the highest quota the worker was given is evidence that its accounting was overwritten (its
        quota is checked inside the worker, whose tenant runs native code there): the worker is killed at once,
        its calls fail with RESOURCE_EXHAUSTED saying so, and its death is its tenant's failure."""
        quota = self.memory_quota_max
        if quota is not None and used > quota:
            fault = ResourceExhausted(
                f"the worker for tenant {self.tenant!r} on device {self.device} reported {used} bytes of device "
                f"memory in use, more than its quota ({quota} bytes): its own accounting was overwritten (by native "
                "code in the worker, such as a kernel writing its memory), and it was killed",
                quota=quota, used=used, device=self.device)
            if self.kill_for_memory("report", fault):
                log.error("tenant %s: %s", self.tenant, fault.message)
            return
        if self.on_memory is not None:
            self.on_memory(self, used)

    def quota_sent(self, quota: int | None) -> None:
        """The front is about to send the worker this memory quota (None: unchanged)."""
        if quota is not None and (self.memory_quota_max is None or quota > self.memory_quota_max):
            self.memory_quota_max = quota

    def kill_for_memory(self, cause: str, fault: GpuBrokerError) -> bool:
        """Kill the worker now, without awaiting, for holding device memory past its quota (``cause``: "nvml" or
        "report"); its calls fail with ``fault``, its death is its tenant's failure. False (and nothing done) when
        it is already being killed for another cause, or is gone."""
        if self.fault is not None or self.death is not None or self.process is None:
            return False
        self.fault = fault
        self.memory_kill = cause
        if self.process.poll() is None:
            self.process.kill()  # (the reader then reports its death, charged to its tenant: it has a fault)
        return True

    async def send_control(self, message: LeaseToWorker) -> None:
        """A lease message to the worker (Grant, Yield or Revoke); no reply."""
        if self.death is not None or self._writer is None:
            raise WorkerCrashed(self.death or "worker not started")
        if isinstance(message, Grant):
            self._want_pending = False
            self._grants_out += 1
        try:
            # (their number is bounded by the grants)
            await self._send(ToWorker(CONTROL, "", message), capped=False)
        except (ConnectionError, OSError):
            await self._died()
            raise self.death_error() from None

    def _queued_bytes(self) -> int:
        """The bytes the front holds toward the worker: in its transport, and waiting for room."""
        assert self._writer is not None
        return self._writer.transport.get_write_buffer_size() + self._waiting_bytes

    async def _send(self, frame: ToWorker[Any], fd: int | Sequence[int] | None = None, capped: bool = True) -> None:
        """Write ``frame`` once the worker's socket has room for it (below the transport's high-water mark).

        Waiting comes before the write, not after: a caller cancelled while it waits (its deadline) leaves
        nothing in the transport, and the transport never holds more than its mark and one frame. The bytes
        waiting are capped (one frame alone always goes, whatever its size), and a worker that reads none of
        them for ``write_stall_seconds`` is killed: its tenant's kernel or compile parks it, or it stopped
        reading on purpose.
        """
        assert self._writer is not None
        writer = self._writer
        size = _frame_size(frame.body)
        queued = self._queued_bytes()
        if capped and queued > 0 and queued + size > self.send_buffer_bytes:
            raise ResourceExhausted(
                f"the worker for tenant {self.tenant!r} on device {self.device} has {queued} bytes of requests "
                f"waiting that it has not read (its device work, a kernel or a compile, keeps it busy): this "
                f"{size}-byte request would pass the {self.send_buffer_bytes}-byte limit "
                "(worker_send_buffer_bytes); retry once its work finishes, or send smaller requests",
                retry_after_seconds=1.0)
        self._waiting_bytes += size
        try:
            async with self._write_lock:
                await self._room(writer)
                if writer.is_closing():  # (retired, or stopped, while this waited: its death is being reported)
                    raise ConnectionResetError("the worker's channel is closed")
                if fd is not None:
                    frame = ToWorker(frame.id, frame.session, msgspec.structs.replace(frame.body,
                                                                                    token=self._send_fd(fd)))
                # Encoded only now, with room for it: a request waiting holds no encoded copy of itself.
                payload = encode(frame)
                writer.writelines((FRAME_HEADER.pack(len(payload)), payload))  # (no joined copy of a large one)
        finally:
            self._waiting_bytes -= size

    async def _room(self, writer: asyncio.StreamWriter) -> None:
        """Until the transport is below its high-water mark; the worker killed if it stalls too long."""
        if writer.transport.get_write_buffer_size() == 0:
            self._stalled_since = None
            return
        now = time.monotonic()
        if self._stalled_since is None:
            self._stalled_since = now
        left = self._stalled_since + self.write_stall_seconds - now
        try:
            await asyncio.wait_for(writer.drain(), max(left, 0.0))
        except TimeoutError:
            if self.fault is None:
                self.fault = ResourceExhausted(
                    f"the worker for tenant {self.tenant!r} on device {self.device} read none of the front's "
                    f"requests for {self.write_stall_seconds:g} s while {self._queued_bytes()} bytes of them "
                    "waited (worker_write_stall_seconds: its kernel or compile kept it from reading) and was killed")
                log.error("tenant %s: %s", self.tenant, self.fault.message)
            if self.process is not None and self.process.poll() is None:
                self.process.kill()  # (the reader then reports its death, charged to its tenant: it has a fault)
            raise self.death_error() from None
        self._stalled_since = None

    def _send_fd(self, fd: int | Sequence[int]) -> bytes:
        if self._fd_sock is None:
            raise FailedPrecondition("worker not started")
        token = secrets.token_bytes(16)
        try:
            socket.send_fds(self._fd_sock, [token], [fd] if isinstance(fd, int) else list(fd))
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
                self._take(await read_reply(reader, self.max_reply_bytes))
        except (FrameClosed, ConnectionError, OSError):
            pass
        except (FrameRefused, WorkerLied) as exc:
            self._lied(str(exc))
        await self._died()

    def _take(self, frame: FromWorker[Raw]) -> None:
        """One frame from the worker (its body still encoded): a reply to a pending request, or a lease message;
        WorkerLied otherwise."""
        req_id, status, body = frame.id, frame.status, frame.body
        if req_id == CONTROL:
            if status != 0:
                raise WorkerLied("a lease message of status 1")
            self._control(decode_control(body))
            return
        pending = self._pending.pop(req_id, None)
        if pending is None:
            if req_id in self._abandoned:
                del self._abandoned[req_id]  # the caller gave up (deadline, cancel); the reply is moot
                return
            raise WorkerLied(f"a reply to request {req_id}, which " + (
                "was already answered" if 0 < req_id <= self._last_id else "the front never made"))
        fut, request, batch = pending
        try:
            if status == 1:
                outcome: Any = decode_error(body)
            else:
                outcome = decode_reply(type(request), body)
                if batch is not None:
                    outcome = check_ack(batch, outcome)
        except WorkerLied:
            self._pending[req_id] = pending  # its caller learns of the worker's death with the others
            raise
        if fut.done():
            return
        if status == 0:
            fut.set_result(outcome)
        else:
            fut.set_exception(outcome)

    def _control(self, message: LeaseToFront) -> None:
        if isinstance(message, Want):
            if self._want_pending:
                raise WorkerLied("a second lease 'want' before the front granted the first")
            self._want_pending = True
        elif isinstance(message, Released):
            if self._grants_out <= 0:
                raise WorkerLied("a lease 'released' with no turn granted")
            self._grants_out -= 1
            if message.memory_used is not None:  # what its links' commands left
                self.memory_reported(message.memory_used)
        if self.on_control is not None:
            self.on_control(message)

    def _lied(self, reason: str) -> None:
        """Kill the worker now for breaking the protocol; the reader then reports its death."""
        if self.fault is None:
            # The reason may quote the worker (a key it sent, in a decode error): escaped, it cannot forge a log line.
            self.fault = WorkerCrashed(f"the worker for tenant {self.tenant!r} on device {self.device} broke the "
                                       f"front's protocol ({escape(reason[:200], quote=False)}) and was killed")
            log.error("tenant %s: %s", self.tenant, self.fault.message)
        if self.process is not None and self.process.poll() is None:
            self.process.kill()

    async def _died(self) -> None:
        # Set before the first await: the reader and a failed write may both get here, and the death must be
        # reported (and charged) once; the later caller waits for the first to finish, so both see `death`.
        if self._dying is not None:
            await asyncio.shield(self._dying)
            return
        self._dying = asyncio.get_running_loop().create_future()
        try:
            await self._report_death()
        finally:
            self._dying.set_result(None)

    async def _report_death(self) -> None:
        code = None
        if self.process is not None:
            try:
                code = await self._wait(5.0)
            except TimeoutError:
                self.process.kill()
                code = await self._wait(None)
        # Its last words (a fatal device error, say) before the line that reports its death.
        await self.output.closed(_OUTPUT_CLOSE_SECONDS)
        await self._release()
        asked = self._stopping or self.retired
        if self.fault is not None:
            self.death = _lost(self.fault.message)
            line = self.death
        else:
            how = _describe_exit(code)
            if self.oom_killed:
                how += f" by the OOM killer (the worker memory limit, {self.memory_max} bytes)"
            who = f"the worker process for tenant {self.tenant!r} on device {self.device} (pid {self.pid})"
            self.death = _lost(f"{who} {how}")
            # (its sessions closed and the front stopped it: the ordinary end, no loss)
            line = f"{who} ended as the front asked" if asked and code == 0 else f"{who} {how}"
        (log.info if asked else log.error)("%s", line)
        for fut, _, _ in self._pending.values():
            if not fut.done():
                fut.set_exception(self.death_error())
        self._pending.clear()
        self._abandoned.clear()
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

    def retire(self, fault: GpuBrokerError) -> None:
        """Kill the worker now, without awaiting anything: a credential it ran something for was revoked, and the
        worker itself runs that credential's holder's code (a thread a kernel left, descriptors it dup'd), so only
        its end ends what the holder may still reach through it. Its calls fail with ``fault``; the death is
        nobody's failure (neither its tenant's crash budget nor the device's health). A worker already being killed
        for a cause keeps that cause."""
        if self.fault is not None or self.death is not None or self.process is None:
            return
        self.retired = True
        self.fault = fault
        if self.process.poll() is None:
            self.process.kill()  # (the launcher; the worker, its PID namespace's init, dies with it)
        # Our end of its channel closes now, so its death is reported at once even if a copy of the worker's end
        # was passed elsewhere before it died.
        if self._writer is not None and not self._writer.is_closing():
            self._writer.close()

    async def kill(self, fault: GpuBrokerError | None = None) -> None:
        """Kill the process; with ``fault``, its pending and later calls fail with that error's class and message."""
        if fault is not None and self.fault is None:
            self.fault = fault
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            await self._wait(None)
        if self._fd_sock is not None:
            self._fd_sock.close()  # (a worker that failed to start never reaches _died)
        if self.process is not None and self.process.returncode is not None:
            await self.output.closed(_OUTPUT_CLOSE_SECONDS)
            await self._release()

    async def _release(self) -> None:
        """Once the launcher is gone: remove the worker's cgroup (once), noting an OOM kill there, and give its host
        uid back once its last process has ended."""
        launch, self._launch = self._launch, None
        if launch is None:
            return
        launch.started()  # (a start that failed before its Popen)
        self.sandbox.free_uid(launch)
        if launch.cgroup is not None:
            self.oom_killed = await asyncio.to_thread(self.sandbox.release, launch) or self.oom_killed

    async def _wait(self, timeout: float | None) -> int:
        """The exit status, waited for off the event loop; TimeoutError if it outlives ``timeout``."""
        assert self.process is not None
        try:
            return await asyncio.to_thread(self.process.wait, timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError from None
