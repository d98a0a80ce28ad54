"""One unauthenticated local uid reconnecting in a tight loop cannot keep the gRPC listener full: its connections
past ``max_grpc_connections_per_peer`` are refused as they are accepted, so the rest of ``max_grpc_connections``
stays for everyone else, and a tenant of another uid opens sessions throughout the flood.

(The hole, found by the last attacker: the per-peer cap was a census every 0.2 s that shut down a peer's newest
connections past it, while gRPC accepted them itself; a peer that took each place back the moment it was shut down
held the listener at its total cap nearly all the time, and the tenant's sessions succeeded 0 of 6. Now the front
accepts the connections and applies both caps at accept: ``src/gpubroker/broker/front/_grpc_peers.py``.)
"""

from __future__ import annotations

import os
import subprocess
import textwrap
import time
from collections.abc import Iterator

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import GpuBrokerError, connect

CAP = 64  # max_grpc_connections
PER_PEER = 8  # max_grpc_connections_per_peer
FLOOD_SECONDS = 12.0
ATTACKER_UID = 65533

FLOODER = textwrap.dedent("""
    import os, selectors, signal, socket, sys, time
    path, n, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    def stop(*_):
        raise SystemExit(0)
    signal.signal(signal.SIGTERM, stop)  # (the test ends the flood once its tries are done)
    sel = selectors.DefaultSelector()
    opened = 0
    def one():
        global opened
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BlockingIOError:
            pass
        except OSError:
            s.close()
            return
        opened += 1
        sel.register(s, selectors.EVENT_READ)
    end = time.monotonic() + seconds
    first_round = True
    try:
        while time.monotonic() < end:
            while len(sel.get_map()) < n and time.monotonic() < end:
                before = len(sel.get_map())
                one()
                if len(sel.get_map()) == before:
                    time.sleep(0.001)
                    break
            for key, _ in sel.select(0.01):
                s = key.fileobj
                try:
                    data = s.recv(65536)
                except OSError:
                    data = b""
                if not data:  # shut down by the broker: take the place again at once
                    sel.unregister(s)
                    s.close()
            if first_round:  # (every place tried once: the flood is on)
                first_round = False
                print("flooding", flush=True)
    finally:
        print(f"opened {opened}", flush=True)
""")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tmp = tmp_path_factory.mktemp("churn")
    settings = {"cache_dir": str(tmp / "caches"), "max_grpc_connections": CAP,
                "max_grpc_connections_per_peer": PER_PEER, "socket_mode": 0o666}
    with BrokerProcess([TenantSpec("alice")], backend="opencl", settings=settings) as proc:
        yield proc


def try_session(broker: BrokerProcess) -> bool:
    try:
        with connect(broker.target, token=broker.tokens["alice"], timeout=3, shared_memory=False,
                     transport="grpc") as gpu:
            gpu.free_memory(gpu.allocate_memory(4096))
        return True
    except GpuBrokerError:
        return False


def test_one_peer_cannot_hold_the_grpc_listener_full(broker: BrokerProcess) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run the flooder as another uid")
    assert try_session(broker), "the tenant could not open a session before the flood"
    path = broker.target.removeprefix("unix:")
    # (the flooder's uid must reach the socket, as a local user in socket_group may: open the test's directories)
    opened: list[tuple[str, int]] = []
    directory = os.path.dirname(path)
    while directory not in ("/", "/tmp", ""):
        opened.append((directory, os.stat(directory).st_mode & 0o7777))
        os.chmod(directory, opened[-1][1] | 0o755)
        directory = os.path.dirname(directory)

    flood = subprocess.Popen(["/usr/bin/python3", "-I", "-c", FLOODER, path, str(CAP), str(FLOOD_SECONDS)],
                             stdout=subprocess.PIPE, text=True, user=ATTACKER_UID, group=ATTACKER_UID, extra_groups=[])
    try:
        assert flood.stdout is not None
        assert flood.stdout.readline().strip() == "flooding"
        tries, ok = 0, 0
        start = time.monotonic()
        while time.monotonic() - start < FLOOD_SECONDS - 3 and tries < 6:
            tries += 1
            ok += try_session(broker)
        assert flood.poll() is None, "the flood ended before the tenant's tries did"
        flood.terminate()  # (it flooded throughout the tries: no need to wait out FLOOD_SECONDS)
        out, _ = flood.communicate(timeout=10)
    finally:
        if flood.poll() is None:
            flood.kill()
            flood.wait()
        for directory, mode in opened:
            os.chmod(directory, mode)
    print(f"\nflooder (uid {ATTACKER_UID}, never sends a byte): {out.strip()}; the tenant's new sessions "
          f"succeeded {ok} of {tries} (3 s each)")
    assert ok == tries, (f"an unauthenticated peer of one uid, capped at {PER_PEER} connections, kept the listener "
                         f"full: the tenant's new sessions succeeded {ok} of {tries} times")
