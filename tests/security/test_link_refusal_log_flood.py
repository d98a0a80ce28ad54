"""One tenant cannot write the front's log at 300 KiB/s with link hellos refused at its link cap (issue 21, round 6).

The hole was: every link hello that authenticates but is then refused (the session's 8 links, ``max_links_per_tenant``,
a hand-off timeout, a session lost) writes an INFO line in the front's log (``_links.py``:
``log.info("no link for session %s: %s", ...)``, about 140 bytes), through no rate limit: not the failure delay (the
token is valid), not the per-tenant limit of the session lines (test_session_churn_log_flood.py), not the refusal
audit's. A tenant (its token; no native code needed) holds 8 links on one session and sends hellos for a ninth on
``<socket>.fast`` as fast as the front answers. The log is the host's disk and the operators' trail; the broker holds
one worker's own output to 8 KiB/s (bursts of 64 KiB), the docs' figure for "log volume".

Measured (2-core VM, PoCL, defaults): one client thread sent 11,397 refused hellos in 5 s; the log grew by 1.5 MiB
(317 KB/s, about 27 GB a day), every line "no link for session ...: this session already has 8 links, the limit".

The fix: refused link hellos are logged through a per-tenant rate limit (20 lines in 10 s, then one line counting
the rest), as a session's opening and end are.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import connect
from gpubroker.wire.frames import pack_frame, recv_frame

KiB = 1024
SECONDS = 3.0
BURST, RATE = 64 * KiB, 8 * KiB  # one worker's output budget: a tenant's hellos should not write more than its code


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    # (the test's own flood of connections from one uid: past the shipped connection rate, which is not what it
    # measures)
    with BrokerProcess([TenantSpec("mallory")], backend="opencl",
                       settings={"connection_burst_per_peer": 100_000}) as proc:
        yield proc


def _hello(path: str, token: str, session: str) -> tuple[socket.socket, int]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)
    sock.sendall(pack_frame({"token": token, "session": session, "link": 1}))
    _, status, _ = recv_frame(sock)
    return sock, status


def test_refused_link_hellos_do_not_flood_the_log(broker: BrokerProcess) -> None:
    token = broker.tokens["mallory"]
    path = broker.target.removeprefix("unix:") + ".fast"
    with connect(broker.target, token=token, transport="grpc") as gpu:
        gpu.allocate_memory(8)
        held = []
        try:
            for _ in range(8):  # the session's links, up to its cap
                sock, status = _hello(path, token, gpu.session)
                held.append(sock)
                assert status == 0
            before = broker.log_path.stat().st_size
            start, refused = time.monotonic(), 0
            while time.monotonic() - start < SECONDS:
                sock, status = _hello(path, token, gpu.session)
                sock.close()
                refused += status != 0
            elapsed = time.monotonic() - start
            grown = broker.log_path.stat().st_size - before
        finally:
            for sock in held:
                sock.close()
    budget = BURST + RATE * elapsed
    assert grown <= budget, (f"{refused} refused link hellos in {elapsed:.1f} s wrote {grown // KiB} KiB of the "
                             f"front's log ({grown / elapsed / KiB:.0f} KiB/s; budget {budget // KiB:.0f} KiB): "
                             f"{broker.log_tail(300)}")
