"""Sessions: a tenant's use of one device, with a lease.

The session's handles (buffers, streams, modules, kernels, segments) are named by its client and resolved by its
worker alone (gpubroker/wire/commands.py): the front keeps no handle table. It keeps what it accounts: a mirror of
each (tenant, device)'s memory use as the worker reports it, and the host memory mapped as shared-memory segments.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeGuard

from gpubroker.broker.config import BrokerConfig
from gpubroker.broker.front._placement import DeviceLoad, NoServingDevice, choose_device
from gpubroker.broker.front.auth import UNAUTHENTICATED_MESSAGE, RateLimitedLog
from gpubroker.broker.front.workers import WorkerClient, WorkerPool
from gpubroker.broker.sandbox import WorkerUidsExhausted
from gpubroker.wire.errors import (
    GpuBrokerError,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    WorkerCrashed,
)
from gpubroker.wire.types import DeviceInfo
from gpubroker.wire.worker import CloseSession, SetLimits, Usage

__all__ = ["END_REASONS", "Admission", "Session", "SessionManager", "out_of_descriptors"]

log = logging.getLogger("gpubroker.sessions")
# How a session ended, as gpubroker_sessions_ended_total's ``how`` (the start of the reason it ended with):
# closed by its client, expired (no heartbeat within the lease), or ended by anyone else (an admin, a drain, the
# broker's stop, its tenant removed).
END_REASONS = ("closed", "expired", "ended")
RECENTLY_ENDED = 4096  # sessions whose end a later call by their id is told
# A link frame's room around a copy chunk (the contract's max frame: chunk_bytes + 64 KiB).
LINK_ENVELOPE = 64 * 1024
# How long a view (placement, admin, metrics) waits for a worker's fresh memory figures before it uses the last.
_USAGE_WAIT = 1.0


def out_of_descriptors(exc: BaseException) -> TypeGuard[OSError]:
    """Whether ``exc`` says the front ran out of file descriptors (its own RLIMIT_NOFILE: EMFILE; the system's
    file table: ENFILE), say while a worker starts (its socketpairs and pipes): the broker's condition for a while,
    neither the tenant's doing nor the device's fault, and no bug."""
    return isinstance(exc, OSError) and exc.errno in (errno.EMFILE, errno.ENFILE)

@dataclass
class Session:
    id: str
    tenant: str
    device: int
    worker: WorkerClient
    lease_seconds: float
    last_seen: float = field(default_factory=time.monotonic)
    memory_used: int = 0  # as the worker last reported it (usage)
    lost: str | None = None  # why the session's device state is gone
    # Why it ended (closed, cancelled, expired, ended by an admin), once it left the list: a stream or link that
    # still holds it (a Commands stream looks its session up once) runs nothing more for it.
    end_reason: str | None = None
    # Whether its client has it: OpenSession answered (until then the open waits for the worker's device info).
    answered: bool = False
    inflight: int = 0
    shared_bytes: int = 0  # host memory mapped for this session as shared-memory segments
    # The sizes of the segments the front registered for it, to uncount each at its release (not a handle
    # table: the worker resolves them; these are the segments' accounting).
    segments: dict[str, int] = field(default_factory=dict)
    # Buffers that copies to or from another device (CopyPeer) use now, by handle: a Free through the front is
    # refused before it unmaps them elsewhere (the worker pins them too, for every path).
    peer_pins: dict[str, int] = field(default_factory=dict)
    # Copies to or from another device under way (CopyPeer): closing waits for them, as another process may be
    # reading this session's memory.
    peer_copies: int = 0
    peer_idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.peer_idle.set()

    def begin_peer_copy(self) -> None:
        self.peer_copies += 1
        self.peer_idle.clear()

    def end_peer_copy(self) -> None:
        self.peer_copies -= 1
        if self.peer_copies == 0:
            self.peer_idle.set()

    def touch(self) -> None:
        self.last_seen = time.monotonic()

    def check_alive(self) -> WorkerClient:
        if self.end_reason is not None:
            raise ended_error(self.id, self.end_reason)
        if self.worker.fault is not None:
            # Killed (or being killed) for a cause: a client that asks why its link dropped learns the cause at
            # once, not a crash, even before the front has noticed the process's exit.
            raise self.worker.death_error()
        if self.lost is not None:
            # A worker killed for a cause (the kernel time limit) fails the session's calls with that status.
            raise self.worker.death_error() if self.worker.death is not None else WorkerCrashed(self.lost)
        return self.worker



def ended_error(session_id: str, reason: str) -> NotFound:
    """What a call naming a session that ended is told: why, and what to do."""
    return NotFound(f"session {session_id!r} has ended: {reason}; open a new session")


class Admission(Protocol):
    """Health's say on new sessions (server/_health.py): a draining broker or a failing device refuses them."""

    def check_open(self, device: int) -> None: ...

    def problem(self, device: int) -> str | None: ...

    def retry_after(self, device: int | None = None) -> float: ...

    def worker_start_failed(self, device: int, error: BaseException) -> None: ...


class SessionManager:
    """Opens, finds, expires and closes sessions; mirrors each (tenant, device)'s memory use."""

    def __init__(self, config: BrokerConfig, pool: WorkerPool, admission: Admission | None = None,
                 devices: Sequence[DeviceInfo] = ()) -> None:
        self.config = config
        self.pool = pool
        self.admission = admission
        self.devices = list(devices)
        self.sessions: dict[str, Session] = {}
        self.recently_ended: dict[str, tuple[str, str]] = {}  # session id -> (tenant, why it ended), oldest first
        self.opening: dict[int, int] = {}  # sessions being opened (worker starting) per device, for placement
        # Sessions being opened per tenant: each holds its place under max_sessions_per_tenant from the check
        # to its registration (or failure), so concurrent opens waiting for one worker start cannot all pass.
        self.reserved: dict[str, int] = {}
        # Called as a session ends, before its worker frees its memory (CopyPeer's caches let go of it there).
        self.closing_hooks: list[Callable[[Session], Awaitable[None]]] = []
        # What abandons a session's work when its client is gone (the service's, as for a cancel): called with the
        # session and what happened to it ("expired (...)"), before its close.
        self.abandon: Callable[[Session, str], Awaitable[None]] | None = None
        # What each tenant's worker on each device reports it uses, clamped to [0, quota] (more than a quota lowered
        # by a reload, allocated before it): placement, views, metrics and admin read it. The worker keeps the
        # quota's accounts; one reporting more than the highest quota it was given is killed
        # (WorkerClient.memory_reported), and on CUDA the NVML watch bounds what it holds (front/_memwatch.py).
        self.memory_used: dict[tuple[str, int], int] = {}
        # Host memory each tenant maps as shared-memory segments, until its worker has unmapped it.
        self.shared_used: dict[str, int] = {}
        # Host memory the front shares with a tenant's workers for no one session (CopyPeer's staging), counted in
        # the tenant's shared memory for as long as a worker of its may hold it.
        self.shared_held: dict[str, int] = {}
        self.draining = False
        # Counters for the metrics, by (tenant, device): what the tenant's workers ran (launches, bytes h2d, d2h,
        # d2h; from their usage reports), sessions opened, and sessions ended by how (``END_REASONS``).
        self.done: dict[tuple[str, int], list[int]] = {}
        self.opened: dict[tuple[str, int], int] = {}
        self.ended: dict[tuple[str, int, str], int] = {}
        # A session's opening and end, logged for each tenant at most 20 lines in 10 s (then a count): a tenant
        # cycling sessions as fast as the front answers wrote 60 KiB/s of the log.
        self.lifecycle_log = RateLimitedLog(log)
        # Set while no session is open: a drain waits on it.
        self.idle = asyncio.Event()
        self.idle.set()
        # gRPC calls in flight per tenant (enter_call), whether they name a session or not.
        self.inflight: dict[str, int] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()  # closes that nobody waits for in line (``end``)
        pool.limits = self.limits
        pool.on_memory = self.mirror

    def enter_call(self, tenant: str) -> None:
        """Count one more of the tenant's calls in flight, or refuse it past ``max_inflight_per_tenant``. A call
        counts from its authentication, before its request is read, to its end (server/_status.py): a request
        that is slow to arrive, or never completes, holds its tenant's place as much as one that runs."""
        calls = self.inflight.get(tenant, 0)
        if calls >= self.config.max_inflight_per_tenant:
            raise ResourceExhausted(f"tenant {tenant!r} already has {calls} calls in flight, the limit")
        self.inflight[tenant] = calls + 1

    def leave_call(self, tenant: str) -> None:
        calls = self.inflight[tenant] - 1
        if calls:
            self.inflight[tenant] = calls
        else:
            del self.inflight[tenant]

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._reaper = asyncio.create_task(self._reap_loop(), name="session-reaper")

    async def stop(self, timeout: float) -> None:
        """End every session, giving their workers ``timeout`` seconds in all to close them (at once, each in its
        own task); the closes left then are abandoned: the workers are stopped next, which frees all they held."""
        if self._reaper is not None:
            self._reaper.cancel()
        for session in list(self.sessions.values()):
            self.end(session, reason="ended: the broker stopped")
        closing = set(self._closing)
        if closing:
            await asyncio.wait(closing, timeout=timeout)
        for task in closing:
            task.cancel()
        await asyncio.gather(*closing, return_exceptions=True)

    def _check_admission(self, device: int) -> None:
        if self.admission is not None:
            self.admission.check_open(device)  # draining, or the device out of service: UNAVAILABLE + retry hint
        elif self.draining:
            raise Unavailable("the broker is draining and accepts no new sessions; retry on another broker")

    async def open(self, tenant: str, device: int | None) -> Session:
        """A new session on ``device``, or (None) on the device that ``place`` picks."""
        # A tenant that keeps crashing its workers is backed off (UNAVAILABLE, retry hint): its crashes are its own.
        self.pool.crashes.check(tenant)
        if device is None:
            # Its links allocate without the front: ask its workers what it holds now, then place.
            await self.refresh_tenant(tenant)
            device = self.place(tenant)
        self._check_admission(device)
        live = sum(1 for s in self.sessions.values() if s.tenant == tenant) + self.reserved.get(tenant, 0)
        if live >= self.config.max_sessions_per_tenant:
            raise ResourceExhausted(f"tenant {tenant!r} already has {live} sessions, the limit; close one first")
        # From here to the registration (or the failure) the session holds its place: nothing below may await
        # outside this try, or the place leaks.
        self.reserved[tenant] = self.reserved.get(tenant, 0) + 1
        self.opening[device] = self.opening.get(device, 0) + 1
        try:
            try:
                worker = await self.pool.get(tenant, device)
            except Exception as exc:
                # (The front short of descriptors, or of host uids for its workers, is neither the device's fault nor
                # the tenant's: not charged.)
                if self.admission is not None and not out_of_descriptors(exc) and not isinstance(
                        exc, WorkerUidsExhausted):
                    self.admission.worker_start_failed(device, exc)
                raise
            if tenant not in self.config.tenants:
                # Removed while its worker started (end_tenant ran meanwhile): neither session nor worker stays.
                self.pool.retire_tenant(tenant, Unauthenticated(UNAUTHENTICATED_MESSAGE))
                raise Unauthenticated(UNAUTHENTICATED_MESSAGE)
            if not worker.alive or worker.retired:
                # (killed as it started: its tenant was removed, and added again meanwhile)
                raise Unavailable("the tenant's worker stopped while it started; retry")
            self._check_admission(device)  # a drain may have begun while the worker started
            session = Session(id=f"ses_{secrets.token_urlsafe(18)}", tenant=tenant, device=device, worker=worker,
                              lease_seconds=self.config.lease_seconds)
            self.sessions[session.id] = session
        finally:
            self.opening[device] -= 1
            self.reserved[tenant] -= 1
            if not self.reserved[tenant]:
                del self.reserved[tenant]
        self.idle.clear()
        self.opened[(tenant, device)] = self.opened.get((tenant, device), 0) + 1
        self.lifecycle_log.log(logging.INFO, f"sessions of tenant {tenant}",
                               "session %s opened for tenant %s on device %d", session.id, tenant, device,
                               extra={"session": session.id, "device": device})
        return session

    def place(self, tenant: str) -> int:
        """The least loaded serving device where the tenant has quota room (see placement.py)."""
        if self.draining:
            self._check_admission(0)  # the drain's own refusal
        if not self.devices:
            return 0  # built without its devices (a test's manager): the first, as before placement
        loads = []
        for device, info in enumerate(self.devices):
            on_device = [s for s in self.sessions.values() if s.device == device and s.lost is None]
            reserved = sum(used for (_, d), used in self.memory_used.items() if d == device)
            loads.append(DeviceLoad(
                device=device, problem=self.admission.problem(device) if self.admission is not None else None,
                sessions=len(on_device) + self.opening.get(device, 0),
                tenant_sessions=sum(1 for s in on_device if s.tenant == tenant),
                room=self.quota(tenant, device) - self.used(tenant, device),
                memory_fraction=reserved / info.total_memory if info.total_memory else 0.0))
        try:
            return choose_device(tenant, loads)
        except NoServingDevice:
            assert self.admission is not None  # without health every device serves
            # Refused as a request for the device that is soonest back would be, with its retry hint.
            self.admission.check_open(min(range(len(loads)), key=self.admission.retry_after))
            raise Unavailable("no device serves new sessions") from None

    def get(self, session_id: str, tenant: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.tenant != tenant:
            ended = self.recently_ended.get(session_id)
            if ended is not None and ended[0] == tenant:
                raise ended_error(session_id, ended[1])
            raise NotFound(f"no session {session_id!r}")
        session.touch()
        return session

    async def close(self, session: Session, reason: str = "closed") -> None:
        """End the session and wait for its worker to close it (its client's own close; others use ``end``)."""
        if self._remove(session, reason):
            await self._closed(session, reason)

    def _remove(self, session: Session, reason: str) -> bool:
        """Take the session off the list (and its tenant's count); False if it had already ended."""
        if self.sessions.pop(session.id, None) is None:
            return False
        session.end_reason = reason
        # Why it ended, for its client's next call (a lease that expired while the client was suspended, say): the
        # last RECENTLY_ENDED of them.
        self.recently_ended[session.id] = (session.tenant, reason)
        if len(self.recently_ended) > RECENTLY_ENDED:
            del self.recently_ended[next(iter(self.recently_ended))]
        how = next((r for r in END_REASONS if reason.startswith(r)), "ended")
        key = (session.tenant, session.device, how)
        self.ended[key] = self.ended.get(key, 0) + 1
        if not self.sessions:
            # (a drain waits for this: the closes under way are the broker's stop's to bound, not the drain's)
            self.idle.set()
        return True

    async def _end(self, session: Session, reason: str, abandon: bool = False) -> None:
        try:
            if abandon and self.abandon is not None:
                await self.abandon(session, "expired (no heartbeat from its client)")
            await self._closed(session, reason)
        except Exception:  # (nobody awaits it: said here, once)
            log.exception("closing session %s of tenant %s failed", session.id, session.tenant)

    async def _closed(self, session: Session, reason: str) -> None:
        """What follows a session's removal from the list: its worker frees what it held, the front uncounts it."""
        await session.peer_idle.wait()  # another device's worker may be reading its memory
        for hook in self.closing_hooks:
            await hook(session)
        if session.lost is None:
            try:
                await session.worker.call(CloseSession(), session.id)
                await self.refresh_usage(session.worker)  # what the session held is free again
            except GpuBrokerError:  # (its worker died or was killed meanwhile, with all the session held)
                pass
        self.release_shared(session, session.shared_bytes)  # the worker's close_session unmapped them
        session.segments.clear()
        self.lifecycle_log.log(logging.INFO, f"sessions of tenant {session.tenant}", "session %s of tenant %s %s",
                               session.id, session.tenant, reason,
                               extra={"session": session.id, "tenant": session.tenant, "device": session.device})

    def end(self, session: Session, reason: str, abandon: bool = False) -> asyncio.Task[None] | None:
        """End the session on behalf of someone other than its client (the lease reaper, an admin, a drain, the
        broker's stop): it leaves the sessions, and its tenant's count, at once; its worker is asked to close it in
        a task of its own, so that a worker that does not answer (its tenant's kernel may hold it for as long as it
        likes) holds up nothing but that close. Until the worker answers (or dies), what the session mapped stays
        counted against its own tenant. The task, or None if the session had already ended. With ``abandon`` (its
        client is gone: an expired lease), its work is abandoned first as a cancel's is (``abandon``)."""
        if not self._remove(session, reason):
            return None
        task = asyncio.create_task(self._end(session, reason, abandon), name=f"close-{session.id}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return task

    def end_tenant(self, tenant: str, reason: str) -> int:
        """End every session of a tenant and kill its workers (the tenant was removed), without asking them: each
        runs the removed tenant's code, which may keep it from answering for as long as it likes, and its death
        frees all it held. The number of sessions ended."""
        self.pool.retire_tenant(tenant, WorkerCrashed(
            f"the worker of tenant {tenant!r} was ended because its tenant was removed"))
        ended = [s for s in self.sessions.values() if s.tenant == tenant]
        for session in ended:
            # Nothing to ask its (killed) worker; the close still runs the hooks (links' watches, CopyPeer's
            # caches) and logs the end.
            session.lost = reason
            session.memory_used = 0
            session.segments.clear()
            session.shared_bytes = 0  # (the tenant's total goes below: a later release must not touch a successor's)
            self.end(session, reason)
        # Nothing of it is left to count (its workers are killed, with their mappings): a tenant added again under
        # its name starts from zero.
        self.shared_used.pop(tenant, None)
        for key in [k for k in self.memory_used if k[0] == tenant]:
            del self.memory_used[key]
        return len(ended)

    def worker_exited(self, worker: WorkerClient) -> None:
        """The worker died or was stopped: its sessions' device memory is gone with it."""
        for session in self.sessions.values():
            if session.worker is worker and session.lost is None:
                session.lost = worker.death or "the worker stopped"
                session.memory_used = 0
                session.segments.clear()
                self.release_shared(session, session.shared_bytes)  # the worker's mappings died with it
        if self.pool.live(worker.tenant, worker.device) is None:  # its device memory went with it
            self.memory_used.pop((worker.tenant, worker.device), None)

    async def _reap_loop(self) -> None:
        interval = max(0.05, min(1.0, self.config.lease_seconds / 4))
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if now - session.last_seen > session.lease_seconds:
                    # (in a task of its own: a worker held in its tenant's kernel never stops the reaping of others)
                    # (its client is gone: whatever it left running is abandoned, as by a cancel, so that the
                    # tenant's next session does not wait behind it)
                    self.end(session, reason=f"expired: no heartbeat from its client within its "
                                             f"{session.lease_seconds:g} s lease (the client process stopped, was "
                                             "suspended, or lost the broker)", abandon=True)
            busy = {(s.tenant, s.device) for s in self.sessions.values() if s.lost is None}
            self.pool.reap_idle(busy)

    # -- memory accounting -------------------------------------------------------------------------
    def quota(self, tenant: str, device: int | None = None) -> int:
        """The tenant's memory quota on ``device`` (None: its default, which applies on each device)."""
        t = self.config.tenants.get(tenant)
        if t is None:
            return 0
        return t.memory_quota if device is None else t.quota_on(device)

    def limits(self, tenant: str, device: int) -> SetLimits:
        """What the worker of (tenant, device) enforces: its memory quota, per-session handles and streams; the
        broker's index of its device (its quota errors name it) and the largest link frame (a copy chunk and the
        batch around it)."""
        return SetLimits(self.quota(tenant, device), self.config.max_handles_per_session,
                         self.config.max_streams_per_session, device, self.config.chunk_bytes + LINK_ENVELOPE)

    def mirror(self, worker: WorkerClient, used: int) -> None:
        """A worker's report of its memory use (checked >= 0 and within the highest quota it was sent by
        WorkerClient), clamped to its tenant's quota now: its tenant's views and the placement of others stay
        bounded."""
        if self.pool.live(worker.tenant, worker.device) is not worker:
            return  # a dead or replaced worker's late report
        self.memory_used[(worker.tenant, worker.device)] = min(used, self.quota(worker.tenant, worker.device))

    async def refresh_tenant(self, tenant: str) -> None:
        """Fresh figures from the tenant's live workers (its placement, its view of the devices)."""
        workers = [w for d in range(max(len(self.devices), 1)) if (w := self.pool.live(tenant, d)) is not None]
        await asyncio.gather(*(self.refresh_usage(w) for w in workers))

    async def refresh_all(self) -> None:
        """Fresh figures from every live worker that has sessions (admin views)."""
        workers = {id(s.worker): s.worker for s in self.sessions.values() if s.lost is None and s.worker.alive}
        await asyncio.gather(*(self.refresh_usage(w) for w in workers.values()))

    async def refresh_usage(self, worker: WorkerClient) -> None:
        """Ask the worker what it uses now, in all and per session (``usage``). A worker busy in a long command
        answers late: the mirror's last figures stand then."""
        try:
            # (decoded as counts >= 0 by session ids of short strings)
            usage = await asyncio.wait_for(worker.call(Usage()), _USAGE_WAIT)
        except (GpuBrokerError, TimeoutError):
            return
        worker.memory_reported(usage.memory_used)
        before = worker.done_reported
        # Counters: what this report adds to the last (a figure that went down is a lie or a bug: nothing added).
        added = [max(0, usage.launches - before[0]), max(0, usage.h2d_bytes - before[1]),
                 max(0, usage.d2h_bytes - before[2]), max(0, usage.d2d_bytes - before[3])]
        worker.done_reported = (before[0] + added[0], before[1] + added[1], before[2] + added[2],
                                before[3] + added[3])
        if any(added):
            totals = self.done.setdefault((worker.tenant, worker.device), [0, 0, 0, 0])
            for i, n in enumerate(added):
                totals[i] += n
        for session in self.sessions.values():
            if session.worker is worker:
                session.memory_used = min(usage.sessions.get(session.id, 0),
                                          self.quota(session.tenant, session.device))

    def used(self, tenant: str, device: int) -> int:
        return self.memory_used.get((tenant, device), 0)

    def reserve_shared(self, session: Session, size: int) -> None:
        """Count a segment before the worker maps it (_segments.py checks the limits first)."""
        session.shared_bytes += size
        self.shared_used[session.tenant] = self.shared_used.get(session.tenant, 0) + size

    def release_shared(self, session: Session, size: int) -> None:
        """Uncount what the worker unmapped; never more than the session still counts (a release may race its close)."""
        size = min(size, session.shared_bytes)
        session.shared_bytes -= size
        left = self.shared_used.get(session.tenant, 0) - size
        if left > 0:
            self.shared_used[session.tenant] = left
        else:
            self.shared_used.pop(session.tenant, None)

    def hold_shared(self, tenant: str, size: int) -> None:
        """Count host memory shared with the tenant's workers for none of its sessions (the caller checked the
        limits); it stays counted across a removal of the tenant until ``unhold_shared``, when no worker holds it."""
        self.shared_held[tenant] = self.shared_held.get(tenant, 0) + size

    def unhold_shared(self, tenant: str, size: int) -> None:
        left = self.shared_held.get(tenant, 0) - size
        if left > 0:
            self.shared_held[tenant] = left
        else:
            self.shared_held.pop(tenant, None)

    def shared(self, tenant: str) -> int:
        """Host memory the tenant shares with its workers now: its sessions' segments and rings, CopyPeer's staging."""
        return self.shared_used.get(tenant, 0) + self.shared_held.get(tenant, 0)
