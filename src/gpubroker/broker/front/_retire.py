"""A revoked credential retires every worker that ran anything for it.

A worker runs its tenant's code as whoever held the token wrote it: a kernel can leave a thread behind, dup the
descriptor of its link, map what it likes. So when a token is rotated (a leak is the usual reason) or its tenant
removed, asking the worker to close what the token opened is not enough: the worker is that token's holder's. The
front kills it instead (the kernel then closes every descriptor it held, dups included, and every thread and
mapping goes with it), without the worker's cooperation. Its sessions end, saying why; the death is nobody's
failure (not the tenant's crash budget, not the device's health); the tenant's next session gets a fresh worker.

"Ran anything for" is what the front hands a worker under a credential: a session opened with it, a call run in one
of its sessions, a link or shared-memory connection attached. One revocation watch (auth.Revocations) per (worker,
credential), registered as the front hands the work over, dropped when the worker dies: a tenant has one token and
a few certificate identities, so a worker holds a few watches at most.
"""

from __future__ import annotations

import functools

from gpubroker.broker.front.auth import REVOKED_CALL_MESSAGE, Authenticator, Principal
from gpubroker.broker.front.workers import WorkerClient, WorkerPool
from gpubroker.wire.errors import Unauthenticated, WorkerCrashed

__all__ = ["WorkerCredentials"]



class WorkerCredentials:
    """The credentials each live worker ran something for; a revocation of one retires those workers."""

    def __init__(self, auth: Authenticator, pool: WorkerPool) -> None:
        self.auth = auth
        self.revocations = auth.revocations
        self.pool = pool
        self._watches: dict[WorkerClient, dict[str, tuple[Principal, int]]] = {}

    def used(self, worker: WorkerClient, principal: Principal) -> None:
        """``worker`` is about to run something for ``principal``. A credential revoked since the call was
        authenticated (a rotation while it waited) gets UNAUTHENTICATED, and nothing runs: its watch would never
        fire, as the revocation has passed."""
        if not self.auth.valid(principal.tenant, principal.credential):
            raise Unauthenticated(REVOKED_CALL_MESSAGE)
        watches = self._watches.get(worker)
        if watches is None:
            if not worker.alive:
                return  # (the call fails on its own: its worker is gone)
            watches = self._watches[worker] = {}
            worker.on_death.append(functools.partial(self._forget, worker))
        elif principal.credential in watches:
            return
        watches[principal.credential] = (principal, self.revocations.watch(
            principal, functools.partial(self._revoked, worker, principal)))

    def __len__(self) -> int:
        return sum(len(w) for w in self._watches.values())

    def _revoked(self, worker: WorkerClient, principal: Principal) -> None:
        """Called by the reload, on the event loop: the kill is a signal and a close, never an await."""
        self._forget(worker)
        if principal.tenant not in self.auth.config.tenants:
            why = "its tenant was removed"
        elif principal.via == "token":
            why = "token rotated"
        else:
            why = "certificate no longer mapped"
        self.pool.retire(worker, WorkerCrashed(
            f"the worker for tenant {worker.tenant!r} on device {worker.device} was ended because the credential "
            f"that used it was revoked ({why}): code run with the old credential must not outlive it"))

    def _forget(self, worker: WorkerClient) -> None:
        for principal, watch in self._watches.pop(worker, {}).values():
            self.revocations.unwatch(principal, watch)
