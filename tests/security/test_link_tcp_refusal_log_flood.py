"""attack4 (fixed): refusals on the TCP link listener (``link_listen``) were not rate-limited: one audit line per
connection, and one entry per connection in the rate limiter's table, which was never pruned.

The hole: ``_links._accept_tcp`` names each connection's listener ``f"{where} peer={address}"`` (the peer's address
and port), and ``PreAuthGate.refused`` rate-limits by ``f"pre-auth refusals on {listener}"``: every TCP connection
is a kind of its own, so ``RateLimitedLog`` (20 lines per kind per 10 s) never limits anything there, and its
``_state`` dict gains an entry per connection, kept for good. An unauthenticated peer that holds its address's 64
places (silent connections) and then connects and closes in a loop gets one ~200-byte audit line per connection
(``address 127.0.0.1 has 64 unauthenticated connections open``), as fast as the front accepts; the same for
connections that time out (``no hello within hello_timeout_seconds``) and malformed hellos (``refuse_malformed``).

Measured (2-core VM shared with a test run, PoCL, link_listen = "127.0.0.1:0"): 1,671 connects in 10 s gave 1,799
audit lines (366 KB of log) where the rate limit means at most ~20 per 10 s (plus one "N more like this" line):
~33 KB/s of log from one peer with no token, indefinitely; the limiter's table grows by as many entries.

Suggested fix: rate-limit by the listener alone (``where``, without ``peer=``), as the Unix and gRPC refusals are,
and put the peer only in the line; bound ``RateLimitedLog._state`` (drop kinds whose window has passed).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec

FLOOD_SECONDS = 5.0
# RateLimitedLog: 20 lines per kind per 10 s, then one line saying how many were left out. Refusals on one
# listener are one kind (the audit's own promise: "a flood of refusals ... cannot fill the disk").
ALLOWED_LINES = 60


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tmp = tmp_path_factory.mktemp("link-tcp-log")
    settings = {"cache_dir": str(tmp / "caches"), "link_listen": "127.0.0.1:0"}
    with BrokerProcess([TenantSpec("alice")], backend="opencl", settings=settings) as proc:
        yield proc


def test_refusals_on_the_tcp_link_listener_are_rate_limited(broker: BrokerProcess) -> None:
    port = broker.link_port
    held = []
    try:
        for _ in range(64):  # max_unauthenticated_per_uid: the address's places, silent (never evicted)
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.5)
        before = broker.log_path.read_text(errors="replace").count("gpubroker.audit")
        connects = 0
        end = time.monotonic() + FLOOD_SECONDS
        while time.monotonic() < end:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5):
                    connects += 1
            except OSError:
                pass
        time.sleep(1.0)
        lines = broker.log_path.read_text(errors="replace").count("gpubroker.audit") - before
    finally:
        for s in held:
            s.close()
    print(f"\n{connects} connects in {FLOOD_SECONDS:g} s past the address's cap: {lines} audit lines")
    assert lines <= ALLOWED_LINES, (f"{connects} refused TCP link connections of one peer without a token wrote "
                                    f"{lines} audit lines in {FLOOD_SECONDS:g} s: not rate-limited")
