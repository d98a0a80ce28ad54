"""One local user (or one remote host with 4 addresses) keeps every scrape of the metrics endpoint refused.

The hole: ``MetricsServer`` counts a connection against ``max_metrics_connections_per_peer`` (4) by its source
address, and ``max_metrics_connections`` (16) in all. Every address of 127.0.0.0/8 is the host's own, so one local
process binds 127.0.0.2 .. 127.0.0.5, holds 4 silent connections from each (16: the total), and reopens each as the
front closes it after ``request_timeout`` (5 s): every other connection, the operator's Prometheus included, is
refused at once ("over max_metrics_connections"). Remotely, 4 IPv4 addresses (or one IPv6 /64) do the same. The
gRPC gate no longer has this hole for its own listeners: it names a loopback peer by the uid owning its socket.

Measured (2-core VM, PoCL, metrics_listen = "127.0.0.1:0"): scrapes succeeded 10 of 10 before; with uid 65533
holding 4 x 4 silent connections from 127.0.0.2-5: 0 of 10 (connection reset).

Suggested fix: name a loopback peer (or one at the host's own address) by the uid owning its socket, as
``_grpc_peers._Owners`` does, and a remote one by its /24 or /64; evict the oldest connection that has sent no
request head yet when the total is reached, rather than refusing the newest.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
import time
import urllib.request
from collections.abc import Iterator

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec

SCRAPES = 10
HOLDER_UID = 65533
SOURCES = "127.0.0.2,127.0.0.3,127.0.0.4,127.0.0.5"

HOLDER = textwrap.dedent("""
    import selectors, socket, sys
    host, port, n, sources = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(",")
    sel = selectors.DefaultSelector()
    def open_one(src):
        s = socket.socket()
        s.bind((src, 0))
        try:
            s.connect((host, port))
        except OSError:
            s.close()
            return
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, src)
    for src in sources:
        for _ in range(n):
            open_one(src)
    print("holding", flush=True)
    while True:
        for key, _ in sel.select(0.05):
            try:
                data = key.fileobj.recv(4096)
            except OSError:
                data = b""
            if not data:
                sel.unregister(key.fileobj)
                key.fileobj.close()
                open_one(key.data)
""")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tmp = tmp_path_factory.mktemp("metrics-peers")
    settings = {"cache_dir": str(tmp / "caches"), "metrics_listen": "127.0.0.1:0"}
    with BrokerProcess([TenantSpec("alice")], backend="opencl", settings=settings) as proc:
        yield proc


def scrapes_ok(broker: BrokerProcess) -> int:
    ok = 0
    for _ in range(SCRAPES):
        try:
            with urllib.request.urlopen(broker.metrics_url, timeout=10) as answer:
                ok += answer.status == 200
        except OSError:
            pass
        time.sleep(0.2)
    return ok


def test_one_local_user_cannot_refuse_every_scrape(broker: BrokerProcess) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run the holder as another uid")
    assert scrapes_ok(broker) == SCRAPES
    host, port = broker.metrics.rsplit(":", 1)

    def drop() -> None:
        os.setgid(HOLDER_UID)
        os.setuid(HOLDER_UID)

    holder = subprocess.Popen(["/usr/bin/python3", "-I", "-c", HOLDER, host, port, "4", SOURCES],
                              stdout=subprocess.PIPE, text=True, preexec_fn=drop)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "holding"
        time.sleep(0.5)
        ok = scrapes_ok(broker)
    finally:
        holder.kill()
        holder.wait()
    print(f"\nwith uid {HOLDER_UID} holding 4 x 4 silent connections from 127.0.0.2-5: {ok} of {SCRAPES} scrapes")
    assert ok == SCRAPES, f"another local user's silent connections refused {SCRAPES - ok} of {SCRAPES} scrapes"
