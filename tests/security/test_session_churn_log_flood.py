"""One tenant cannot write the front's log at 60 KiB/s by opening and closing sessions (issue 21, round 5).

The hole was: every OpenSession and CloseSession writes an INFO line (``gpubroker.sessions``: "session ... opened for
tenant ... on device 0", "session ... of tenant ... closed"), about 230 bytes a cycle, and nothing bounds how often a
tenant may cycle: ``max_sessions_per_tenant`` counts open sessions, ``max_inflight_per_tenant`` calls in flight,
neither a rate. A session on a worker that is already up costs the tenant a couple of round trips. So a tenant
(its token; no native code needed) writes the front's log as fast as the front answers, while the broker holds each
worker's own output to 8 KiB/s (bursts of 64 KiB), the figure the security docs give for "log volume". The log is the
host's disk (journald or a file) and the operators' audit trail: at this rate 5 GB a day from one tenant, and
journald's rate limit, where it applies, then drops *other* tenants' and the audit logger's lines with it.

Measured (2-core VM, PoCL, defaults): 3 threads of one tenant, each ``connect(...); close()`` in a loop, made 1,328
sessions in 5 s; the log grew by 309 KiB (62 KiB/s; a ``transport="link"`` session: 39 KiB/s).

The fix: a session's opening and end are logged through a per-tenant rate limit (20 lines in 10 s, then one line
counting the rest, as refusals are audited).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import connect

KiB = 1024
SECONDS = 5.0
THREADS = 3
# The budget the broker gives one worker's output (8 KiB/s, bursts of 64 KiB): a tenant's own calls should not
# write more of the log than its code may.
BURST, RATE = 64 * KiB, 8 * KiB


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tmp = tmp_path_factory.mktemp("churn-log")
    # (the calls' per-peer rate is held high: this test floods the log, not the front's calls)
    with BrokerProcess([TenantSpec("mallory")], backend="opencl",
                       settings={"cache_dir": str(tmp / "caches"), "max_grpc_calls_per_peer_per_second": 100_000.0,
                                 "grpc_call_burst_per_peer": 100_000}) as proc:
        yield proc


def test_a_tenant_cannot_flood_the_log_by_cycling_sessions(broker: BrokerProcess) -> None:
    token = broker.tokens["mallory"]
    with connect(broker.target, token=token, timeout=60, transport="grpc", shared_memory=False) as first:
        first.free_memory(first.allocate_memory(16))  # (the worker is up: cycles cost no worker start)
        before = broker.log_path.stat().st_size
        start = time.monotonic()
        stop = start + SECONDS
        cycles: list[int] = []

        def churn() -> None:
            n = 0
            while time.monotonic() < stop:
                connect(broker.target, token=token, timeout=60, transport="grpc", shared_memory=False).close()
                n += 1
            cycles.append(n)

        threads = [threading.Thread(target=churn) for _ in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.monotonic() - start
        grown = broker.log_path.stat().st_size - before
    budget = BURST + RATE * elapsed
    print(f"\n{sum(cycles)} session cycles in {elapsed:.1f} s; the log grew by {grown // KiB} KiB "
          f"({grown / elapsed / KiB:.0f} KiB/s); a worker's output may write {budget // KiB:.0f} KiB in that time")
    assert sum(cycles) >= 100, f"only {sum(cycles)} session cycles: the flood did not happen"
    assert grown <= budget, (f"one tenant wrote {grown // KiB} KiB of the front's log in {elapsed:.1f} s "
                             f"({sum(cycles)} OpenSession/CloseSession cycles), past the {budget // KiB:.0f} KiB "
                             "a worker's output may")
