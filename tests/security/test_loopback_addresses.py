"""Every address of 127.0.0.0/8 is the host's own: a local user binding 127.0.0.2 .. 127.0.0.5 is still one peer,
on the link's TCP port and on the metrics endpoint, and no TCP peer can take the places of the ``.fast`` sockets.

(The holes, found at the end of issue 21. The pre-authentication caps counted a TCP link connection by its source
address, with one total (``max_unauthenticated_connections``, 256) across every raw listener, ``.fast`` included: a
local user without a token holding 64 silent connections (``max_unauthenticated_per_uid``) from each of 4 loopback
addresses held all 256 places, and every tenant's ``.fast`` link failed ("the broker's unix link did not answer its
hello"): 0 of 10. The metrics endpoint counted ``max_metrics_connections_per_peer`` (4) by address too: 4 silent
connections from each of 4 addresses held ``max_metrics_connections`` (16), and every scrape was refused: 0 of 10.
Remotely, 4 IPv4 addresses or one IPv6 /64 did the same. Now every listener names its peers alike
(``listeners.peer_of``): a TCP peer on this host by the uid owning its socket (sock_diag), a remote one by its /24 or
/64; and each kind of raw listener (Unix, TCP, vsock) has a total of its own.)
"""

from __future__ import annotations

import os
import socket
import subprocess
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import msgpack
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import GpuBrokerError, connect
from gpubroker.wire.frames import pack_frame, recv_payload, send_payload

CALLS = 10
HOLDER_UID = 65533  # another local user, without a token
PER_UID = 16
SOURCES = "127.0.0.2,127.0.0.3,127.0.0.4,127.0.0.5"
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # a local endpoint: never via a proxy

# Holds N silent connections from each source address to HOST:PORT, reopening each one the broker closes.
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
    if os.geteuid() != 0:
        pytest.skip("needs root to run the holder as another uid")
    tmp = tmp_path_factory.mktemp("loopback-addresses")
    settings = {"cache_dir": str(tmp / "caches"), "link_listen": "127.0.0.1:0", "metrics_listen": "127.0.0.1:0",
                # (a total of 4 users' shares: the test's holders fill it with few connections)
                "max_unauthenticated_connections": 4 * PER_UID, "max_unauthenticated_per_uid": PER_UID,
                # (figures taken for every scrape: at the default, once a second, each paced scrape waited ~1 s
                # for the next refresh; and a silent connection closed after 2 s, not 5, so the ~2 s of paced
                # scrapes still span the holder's reconnections)
                "metrics_refresh_seconds": 0.0, "metrics_request_timeout_seconds": 2.0}
    with BrokerProcess([TenantSpec("alice")], backend="opencl", settings=settings) as proc:
        yield proc


@contextmanager
def holding(host: str, port: int, per_source: int, uids: tuple[int, ...] = (HOLDER_UID,),
            sources: str = SOURCES) -> Iterator[None]:
    """Other local users (``uids``), each holding ``per_source`` silent connections to HOST:PORT from each of
    ``sources`` (their connects all returned: they are in the listener's queue or accepted)."""
    holders = []
    try:
        for uid in uids:
            holder = subprocess.Popen(["/usr/bin/python3", "-I", "-c", HOLDER, host, str(port), str(per_source),
                                       sources], stdout=subprocess.PIPE, text=True, user=uid, group=uid,
                                       extra_groups=[])
            holders.append(holder)
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == "holding"
        yield
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()


def links_ok(broker: BrokerProcess) -> tuple[int, list[str]]:
    ok, errors = 0, []
    for _ in range(CALLS):
        try:
            with connect(broker.target, token=broker.tokens["alice"], timeout=10, transport="link") as gpu:
                gpu.free_memory(gpu.allocate_memory(4096))
                ok += 1
        except GpuBrokerError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        time.sleep(0.2)  # (paced, so that the calls span the holder's reconnections)
    return ok, errors


def test_silent_tcp_link_connections_cannot_refuse_the_tenants_unix_links(broker: BrokerProcess) -> None:
    assert links_ok(broker)[0] == CALLS
    with holding("127.0.0.1", broker.link_port, PER_UID):  # 4 x max_unauthenticated_per_uid: the old total
        # One more connection, after the holder's in the listener's queue: once it is answered (a malformed hello
        # is), or refused, the front has accepted every one of the holder's.
        with socket.create_connection(("127.0.0.1", broker.link_port), timeout=10) as probe:
            probe.sendall(pack_frame([1]))
            try:
                probe.recv(1)
            except ConnectionResetError:
                pass
        ok, errors = links_ok(broker)
    print(f"\nwith uid {HOLDER_UID} holding 4 x {PER_UID} silent TCP link connections, alice's unix links: {ok} of "
          f"{CALLS}; {errors[:1]}")
    assert ok == CALLS, (f"another local user's silent TCP connections to link_listen made {CALLS - ok} of {CALLS} "
                         f"of alice's .fast links fail: {errors[:1]}")


def scrapes_ok(broker: BrokerProcess) -> int:
    ok = 0
    for _ in range(CALLS):
        try:
            with _HTTP.open(broker.metrics_url, timeout=10) as answer:
                ok += answer.status == 200
        except OSError:
            pass
        time.sleep(0.2)  # (paced, so that the scrapes span the holder's reconnections)
    return ok


def test_one_local_user_cannot_refuse_every_scrape(broker: BrokerProcess) -> None:
    assert scrapes_ok(broker) == CALLS
    host, port = broker.metrics.rsplit(":", 1)
    # 4 x max_metrics_connections_per_peer (4): max_metrics_connections. (The first scrape comes after the holder's
    # connections in the listener's queue: it sees every one of them accepted.)
    with holding(host, int(port), 4):
        ok = scrapes_ok(broker)
    print(f"\nwith uid {HOLDER_UID} holding 4 x 4 silent connections from 127.0.0.2-5: {ok} of {CALLS} scrapes")
    assert ok == CALLS, f"another local user's silent connections refused {CALLS - ok} of {CALLS} scrapes"


def _tcp_hellos_ok(broker: BrokerProcess, hello: bytes) -> tuple[int, list[str]]:
    ok, errors = 0, []
    for _ in range(CALLS):
        try:
            with socket.create_connection(("127.0.0.1", broker.link_port), timeout=10) as sock:
                send_payload(sock, hello)
                _, status, result = msgpack.unpackb(recv_payload(sock, 1 << 16))
            if status == 0:
                ok += 1
            else:
                errors.append(f"{result['code']}: {result['message']}")
        except (OSError, ValueError, EOFError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        time.sleep(0.2)  # (paced, so that the hellos span the holders' reconnections)
    return ok, errors


def test_silent_tcp_connections_of_many_users_cannot_refuse_a_tenants_tcp_link(broker: BrokerProcess) -> None:
    """At the TCP listeners' total, a connection that has sent nothing makes room for a new one (as on ``.fast``):
    four local users (or four remote networks) each holding their share of silent connections held every TCP
    place for hello_timeout_seconds at a time, reconnecting, and every tenant's TCP link was refused."""
    with connect(broker.target, token=broker.tokens["alice"], timeout=30, transport="grpc",
                 shared_memory=False) as gpu:
        hello = msgpack.packb({"token": broker.tokens["alice"], "session": gpu.session, "link": 1})
        assert _tcp_hellos_ok(broker, hello)[0] == CALLS
        with holding("127.0.0.1", broker.link_port, PER_UID, uids=(65530, 65531, 65532, 65533),
                     sources="127.0.0.1"):
            ok, errors = _tcp_hellos_ok(broker, hello)
    print(f"\nwith 4 local users each holding {PER_UID} silent TCP link connections (the TCP total): alice's TCP "
          f"link hellos: {ok} of {CALLS}; {errors[:1]}")
    assert ok == CALLS, f"silent TCP connections of 4 users refused {CALLS - ok} of {CALLS} TCP links: {errors[:1]}"
