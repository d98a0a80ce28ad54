"""Any tenant (its token; no native code, no session) writes an audit line into the front's log per Admin call it
is refused: ``gpubroker.audit WARNING denied: tenant=... action=Status (not an admin)``, unthrottled.

The hole: ``Principal.require_admin`` (broker/front/auth.py) logs every refusal with ``audit.warning``, not through
a ``RateLimitedLog`` as every other refusal a peer can repeat is (authentication failures, link and segment
refusals, session churn: test_session_churn_log_flood.py). The only bound is the per-peer gRPC call rate
(``max_grpc_calls_per_peer_per_second`` 500, burst 1,000), far above what the log can take: a non-admin tenant
writes the audit log at the front's unary-call rate, and a flood of "denied" lines from one tenant buries the
audit trail operators read (and, behind journald's rate limit, drops other tenants' and the audit logger's lines).

Measured (2-core VM, PoCL, defaults): 4 threads of a non-admin tenant calling ``Admin.Status`` for 4 s (each
reconnecting when the call rate cuts its connection): 2,996 refusals, 2,996 "denied" lines, the log grew by
300 KiB (75 KiB/s, held down only by the call rate's 500 a second; the budget the broker gives a worker's own output
is 8 KiB/s, bursts of 64 KiB). Every local uid and remote /24 has a call rate of its own.

The fix: refused Admin calls are audited per tenant at most 20 lines in 10 s, then a count.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.v1 import admin_pb2 as apb
from gpubroker.v1 import admin_pb2_grpc as apb_grpc

from ._probes import tenant_credentials

KiB = 1024
SECONDS = 4.0
THREADS = 4
# What a tenant's own calls may write of the log: the budget of its worker's output (8 KiB/s, bursts of 64 KiB).
BURST, RATE = 64 * KiB, 8 * KiB


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tmp = tmp_path_factory.mktemp("denied-log")
    with BrokerProcess([TenantSpec("ops", admin=True), TenantSpec("mallory")], backend="opencl",
                       settings={"cache_dir": str(tmp / "caches")}) as proc:
        yield proc


def test_a_non_admin_cannot_flood_the_audit_log_with_refused_admin_calls(broker: BrokerProcess) -> None:
    credentials = tenant_credentials(broker, "mallory")
    before = broker.log_path.stat().st_size
    denied: list[int] = []
    start = time.monotonic()
    stop = start + SECONDS

    def flood() -> None:
        n = 0
        while time.monotonic() < stop:  # (a connection cut for the call rate: the next one goes on)
            with grpc.secure_channel(broker.target, credentials) as channel:
                admin = apb_grpc.AdminStub(channel)
                while time.monotonic() < stop:
                    try:
                        admin.Status(apb.StatusRequest(), timeout=30)
                    except grpc.RpcError as exc:
                        if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                            n += 1
                        elif exc.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
                            break
                        else:
                            raise
        denied.append(n)

    threads = [threading.Thread(target=flood) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    grown = broker.log_path.stat().st_size - before
    lines = broker.log_path.read_text(errors="replace").count("(not an admin)")
    budget = BURST + RATE * elapsed
    print(f"\n{sum(denied)} Admin.Status calls of a non-admin refused in {elapsed:.1f} s: {lines} 'denied' lines, the "
          f"log grew by {grown // KiB} KiB ({grown / elapsed / KiB:.0f} KiB/s; budget {budget / KiB:.0f} KiB)")
    assert sum(denied) > 200, "the flood made too few calls to tell (a loaded machine?)"
    assert grown <= budget, (f"a non-admin tenant's refused Admin calls wrote {grown // KiB} KiB of the log in "
                             f"{elapsed:.1f} s ({lines} lines), past {budget / KiB:.0f} KiB")
