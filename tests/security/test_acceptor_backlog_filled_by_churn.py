"""Another local user's connect/close churn fills the listeners' backlog: every other client's NEW connection fails.

The hole (issue 21, found by a fresh attacker): every raw listener accepts in the front's acceptor process, at
nice +10, which names each peer and closes what its per-peer connection rate refuses. That keeps the front's loop
free, but the acceptor is one process at a low priority working through one backlog (``listen(128)``, 1024 on the
gRPC socket) shared by every peer: a local user connecting and closing in a loop (no byte sent, no token) queued
connections faster than the acceptor refused them, the backlog stayed full, and a Unix-socket ``connect()`` by
anyone else then failed at once (``EAGAIN``: a non-blocking connect to a full backlog), which gRPC reports as
``UNAVAILABLE``. The per-peer rate could not help: the refused connections were in the one queue before it applied.
Measured (PoCL broker, 2 shared cores; two churners of one uid, ``connect(); close()`` in a loop, ~20,000 a second
each): 2-13 of alice's 20 new channels failed UNAVAILABLE, the rest 45 ms p50 (4-5 ms before); 16-87 % of
non-blocking connects failed. A backlog of 4096 and a leaner refusal path alone did not do (3-12 of 20 failed,
the backlog full at every sample even with the acceptor at nice -5: it was runnable all the time and got a third
of a core on this loaded machine), nor would any CPU priority against enough churning processes: the kernel
work of a refusal (accept + close, ~7 us) is about that of a connect.

The fix (``_acceptor.ChurnBans``): a uid refused for its connection rate 1,000 times within a second is refused
by the kernel at ``connect()`` from then on, for 10 s doubling while it goes on (up to 300 s): an empty POSIX ACL
entry for it on every Unix socket file of the front (a named user's entry decides before its groups). Its
connects fail with EACCES before a connection exists, so the backlog drains, whatever CPU it spends. The test
checks, for the gRPC socket and ``.fast``: the churning uid banned, and not one of alice's new connections failing
while it churns. (Left: between bans the churn reaches the backlog again until it is refused 1,000 times more;
TCP listeners have no such ban. docs/operator/security.md, Known gaps.)
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import subprocess
import textwrap
import time
from collections.abc import Iterator

import grpc
import pytest

from gpubroker.broker.front._acceptor import BAN_SECONDS
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

from ..helpers import wait_for
from ._probes import open_to_other_users, tenant_credentials

CHURNERS = 2
GRPC_ATTEMPTS = 20
CONNECT_ATTEMPTS = 100
CHURN_SECONDS = 60.0  # (killed once measured)
MEASURE_SECONDS = BAN_SECONDS / 2  # alice's channels, then one more second of connects

CHURNER = textwrap.dedent(r"""
    import errno, signal, socket, sys, time
    path, seconds = sys.argv[1], float(sys.argv[2])
    signal.signal(signal.SIGTERM, lambda *_: sys.exit())
    print("churning", flush=True)
    n = denied = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(path)
                n += 1
            except OSError as exc:
                denied += exc.errno == errno.EACCES
            s.close()
    finally:
        print(f"connections {n} denied (EACCES) {denied}", flush=True)
""")


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tmp = tmp_path_factory.mktemp("backlog-churn")
    with BrokerProcess([TenantSpec("alice")], backend="opencl",
                       settings={"cache_dir": str(tmp / "caches"), "socket_mode": 0o666}) as proc:
        open_to_other_users(proc)
        yield proc


def _banned(path: str, uid: int) -> bool:
    """The socket file at ``path`` has an ACL entry for ``uid`` (a named user's: tag ACL_USER)."""
    try:
        acl = os.getxattr(path, "system.posix_acl_access")
    except OSError:
        return False
    return any(tag == 0x02 and ident == uid for tag, _, ident in struct.iter_unpack("<HHI", acl[4:]))


def _new_channels(broker: BrokerProcess, n: int, deadline: float = float("inf")) -> tuple[int, list[str]]:
    """Open ``n`` new channels as alice (as many as ``deadline`` leaves time for), one call each: how many were
    opened, and what failed."""
    credentials = tenant_credentials(broker, "alice")
    failed = []
    for tried in range(n):
        if time.monotonic() > deadline:
            return tried, failed
        try:
            with grpc.secure_channel(broker.target, credentials) as channel:
                pb_grpc.GpuBrokerStub(channel).ListDevices(pb.ListDevicesRequest(), timeout=30)
        except grpc.RpcError as exc:
            failed.append(f"{exc.code().name}: {(exc.details() or '')[:160]}")
        time.sleep(0.05)  # (not synchronisation: alice's channels spread over the churn)
    return n, failed


def _connects(path: str, n: int, deadline: float) -> tuple[int, list[str]]:
    """``n`` non-blocking connects to ``path`` (as many as ``deadline`` leaves time for), as a client library opens
    a connection: how many were made, and what failed."""
    failed = []
    for tried in range(n):
        if time.monotonic() > deadline:
            return tried, failed
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.setblocking(False)
            try:
                sock.connect(path)
            except OSError as exc:
                failed.append(errno.errorcode.get(exc.errno or 0, str(exc.errno)))
        time.sleep(0.01)  # (not synchronisation: the connects spread over the churn)
    return n, failed


@pytest.mark.parametrize(("suffix", "attacker"), [("", 65533), (".fast", 65532)], ids=["grpc-socket", "fast-socket"])
def test_another_users_churn_does_not_fail_new_connections(broker: BrokerProcess, suffix: str, attacker: int) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run the churner as another uid")
    path = broker.target.removeprefix("unix:") + suffix
    if suffix == "":
        assert not _new_channels(broker, 3)[1]
    churners = [subprocess.Popen(["/usr/bin/python3", "-I", "-c", CHURNER, path, str(CHURN_SECONDS)],
                                 stdout=subprocess.PIPE, text=True, user=attacker, group=attacker, extra_groups=[])
                for _ in range(CHURNERS)]
    try:
        for churner in churners:
            assert churner.stdout is not None and churner.stdout.readline().strip() == "churning"
        try:
            wait_for(lambda: _banned(path, attacker), 10.0, f"uid {attacker} banned from {path}")
            banned = True
        except AssertionError:
            banned = False  # (measured all the same: what the churn does to alice's connections is the point)
        # Measured within the first ban (a busy machine's slow channels must not outlast it: a churn resumed
        # after the ban is the gap the docs say), and throughout the churn without one.
        deadline = time.monotonic() + MEASURE_SECONDS
        channels, failed_channels = _new_channels(broker, GRPC_ATTEMPTS, deadline) if suffix == "" else (0, [])
        connects, failed_connects = _connects(path, CONNECT_ATTEMPTS, deadline + 1.0)
    finally:
        for churner in churners:
            churner.terminate()
        outs = [churner.communicate(timeout=30)[0].strip() for churner in churners]
    print(f"\nuid {attacker} churning {path} ({CHURNERS} processes; banned: {banned}): {outs}; alice's new "
          f"channels failed: {len(failed_channels)} of {channels}; non-blocking connects failed: "
          f"{len(failed_connects)} of {connects} {sorted(set(failed_connects))}")
    assert not failed_channels, (f"{len(failed_channels)} of alice's {channels} new channels failed while uid "
                                 f"{attacker} connected and closed in a loop: {failed_channels[0]}")
    assert not failed_connects, (f"{len(failed_connects)} of {connects} non-blocking connects to {path} "
                                 f"failed while uid {attacker} connected and closed in a loop: "
                                 f"{sorted(set(failed_connects))}")
    assert connects >= 20 and (suffix != "" or channels >= 5), f"too few tries: {channels} channels, {connects} " \
                                                                "connects"
    assert banned, f"uid {attacker}'s connect/close loop was never refused at connect"
