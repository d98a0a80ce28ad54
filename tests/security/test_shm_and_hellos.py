"""The raw same-host socket before and around authentication (issue 21, items 10-12), attacked through a real
broker on PoCL: malformed hellos on ``<socket>.fast`` (asking for a link or for shared-memory segments), floods of
authenticated segment connections and of silent connections, and shared host memory past a tenant's quota across
its sessions; and (round 2) descriptors sent a byte at a time for the front to hold, and the front at its
descriptor limit; and (round 3) a segment whose memfd holds more than the size it announces (and is charged for),
which a kernel in the worker then fills. (Until issue 22, segments had a socket of their own, ``<socket>.shm``,
with its own authentication; the attacks on it are the same on the link socket's segment connections.)

Each attack is what a hostile local client does with raw sockets (or the SDK's own calls); each test asserts what
the broker must do: answer or close, audit and delay a malformed hello and never log a traceback; keep serving
another tenant (and the flooded tenant itself) shared memory; refuse a tenant's shared bytes past its own limit.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import itertools
import os
import random
import re
import resource
import socket
import struct
import time
import warnings
from collections.abc import Iterator

import grpc
import msgpack
import numpy as np
import pytest

from gpubroker.broker.config import BrokerConfig
from gpubroker.broker.front._descriptors import PASSRIGHTS_SUPPORTED
from gpubroker.broker.front._preauth import PreAuthGate, Ticket
from gpubroker.broker.front.listeners import peer_of
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import AdminClient, InvalidArgument, ModuleFormat, RemoteGpu, ResourceExhausted, connect
from gpubroker.client._channel import make_channel
from gpubroker.client._shm import SegmentChannel, create_segment_fd
from gpubroker.client._transports import peer_hung_up
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

from ..conftest import worker_pids
from ..helpers import wait_for
from .exploits import SYSCALL_SOURCE, check_arch

QUOTA = 128 << 20  # alice's memory quota: by default, also the shared host memory all her sessions may map
DELAY_MAX = 0.3  # auth_failure_delay_max_seconds: the delay a peer's repeated failures grow to
# hello_timeout_seconds: long, so that a flood of silent connections stays in place for as long as a test needs it
# (however loaded the machine): the flood must be defeated while it lasts, not outlived.
HELLO_TIMEOUT = 60.0
# (dora opens her first session only while the front is out of descriptors: her worker is not started before.)
TENANTS = [TenantSpec("alice", memory_quota=QUOTA), TenantSpec("bob"), TenantSpec("mallory"), TenantSpec("dora"),
           TenantSpec("ops", admin=True)]
# What one connection may cost the front in descriptors, its own socket included, with room for the front's own
# passing ones (the CPU watch opens /proc directories).
DESCRIPTORS_PER_PEER = 8


@pytest.fixture(scope="module")
def broker(backend: str) -> Iterator[BrokerProcess]:
    settings = {"auth_failure_delay_max_seconds": DELAY_MAX, "hello_timeout_seconds": HELLO_TIMEOUT}
    with BrokerProcess(TENANTS, backend=backend, settings=settings) as proc:
        yield proc


def _path(broker: BrokerProcess) -> str:
    """The link socket, where links and segment connections both say their hello."""
    return broker.target.removeprefix("unix:") + ".fast"


def _log(broker: BrokerProcess) -> str:
    return broker.log_path.read_text(errors="replace")


def _reply(sock: socket.socket) -> object:
    """The broker's one answer frame, or None if it closed without one."""
    data = b""
    while True:
        part = sock.recv(65536)
        if not part:
            break
        data += part
    if len(data) < 4:
        return None
    (length,) = struct.unpack("!I", data[:4])
    return msgpack.unpackb(data[4:4 + length], raw=False)


def _error(reply: object) -> dict[str, str]:
    """The error in a refusal: ``[0, 1, error]``."""
    assert isinstance(reply, list) and len(reply) == 3 and reply[1] == 1, reply
    return dict(reply[2])


def _frame(obj: object) -> bytes:
    payload = msgpack.packb(obj)
    return struct.pack("!I", len(payload)) + payload


def _raw(payload: bytes) -> bytes:
    return struct.pack("!I", len(payload)) + payload


def _malformed(purpose: str) -> dict[str, bytes]:
    """Hellos that are no hellos, asking for ``purpose`` ("link" or "segments"): each must be answered
    (INVALID_ARGUMENT) or, if cut short, closed, and audited."""
    return {
        "list-as-map-key": _raw(b"\x81\x90\xc0"),  # {[]: nil}: the 3 bytes (a key that is no string)
        "map-as-map-key": _raw(b"\x81\x80\xc0"),
        "reserved-byte": _raw(b"\xc1"),
        "extra-data": _raw(b"\x91\xc0\x00"),
        "map-then-extra-data": _raw(b"\x81\xa4link\x01\x00"),
        "bad-utf8": _raw(b"\xa2\xff\xfe"),
        "bad-utf8-token": _raw(b"\x81\xa5token\xa2\xff\xfe"),
        "deep-nesting": _raw(b"\x91" * 3000 + b"\xc0"),
        "deep-nesting-in-a-field": _raw(b"\x82\xa4link\x01\xa1x" + b"\x91" * 30000 + b"\xc0"),
        "huge-array-length": _raw(b"\xdd\xff\xff\xff\xff"),
        "not-a-map": _frame([1, 2]),
        "token-int": _frame({"token": 7, "session": "ses_x", purpose: 1}),
        "token-list": _frame({"token": ["gpb_x"], "session": "ses_x", purpose: 1}),
        "token-huge": _frame({"token": "gpb_" + "x" * 5000, "session": "ses_x", purpose: 1}),
        "session-map": _frame({"token": "gpb_x_y", "session": {"a": 1}, purpose: 1}),
        "wrong-types": _frame({"token": "gpb_x_y", "session": "ses_x", purpose: "1", "size": "big", "release": 5,
                               "hello": "yes"}),
        "compress-not-names": _frame({"token": "gpb_x_y", "session": "ses_x", purpose: 1, "compress": [1, None]}),
        "cut-short": struct.pack("!I", 100) + b"\x81\xa5token",  # a header for 100 bytes, 10 of them, then the end
    }


@pytest.mark.parametrize("purpose", ["link", "segments"])
def test_malformed_hellos_are_answered_audited_and_delayed_never_a_traceback(broker: BrokerProcess,
                                                                             purpose: str) -> None:
    path = _path(broker)
    took: dict[str, float] = {}
    malformed = _malformed(purpose)
    start = len(_log(broker))
    for name, data in malformed.items():
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(20)
            sock.connect(path)
            started = time.monotonic()
            sock.sendall(data)
            if name == "cut-short":
                sock.shutdown(socket.SHUT_WR)
            reply = _reply(sock)
            took[name] = time.monotonic() - started
        if name == "cut-short":
            assert reply is None, reply  # nothing to answer: the peer is gone; closed
        else:
            assert reply is not None, f"{purpose}: {name}: closed without an answer"
            error = _error(reply)
            assert error["code"] == "INVALID_ARGUMENT" and "malformed" in error["message"], (name, error)
    # Extra fields are a newer client's, not malformed: answered as any hello is (here: a token that is none).
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(20)
        sock.connect(path)
        sock.sendall(_frame({"token": "gpb_000000000000_bogus", "session": "ses_x", purpose: 1, "hello": 1,
                             "extra": [1, {"k": None}]}))
        assert _error(_reply(sock))["code"] == "UNAUTHENTICATED"
    # The failure delay: every malformed hello is charged to its peer (uid) as a failed authentication, so a run
    # of them is held back (it doubles from 2 ms up to auth_failure_delay_max_seconds).
    assert took["wrong-types"] >= DELAY_MAX * 0.9, took
    log = _log(broker)[start:]
    assert "Traceback" not in log, log[log.index("Traceback") - 500:][:3000]
    audited = [line for line in log.splitlines() if "reason=malformed hello" in line and path in line]
    # The audit says what is wrong: here, a key that is no string (the 3 bytes).
    assert any("Expected `str`, got `array` - at `key`" in line for line in audited), audited

    def counted() -> int:  # in full, or (past the audit's burst per listener) in its count of the rest
        lines = _log(broker)[start:].splitlines()
        full = sum("reason=" in line and path in line for line in lines)
        rest = sum(int(m.group(1)) for line in lines
                   if (m := re.search(rf"pre-auth refusals on unix:{re.escape(path)}: (\d+) more", line)))
        return full + rest

    wait_for(lambda: counted() >= len(malformed), 15, "every refusal to be audited or counted")
    _copy_and_check(broker, "bob")  # and the broker serves on


def _mutations(seed: int, n: int, purpose: str) -> list[bytes]:
    """Frames made from a well-formed hello by a fuzzer's edits: flipped bytes, cuts, insertions, random bytes.
    The frame's header always matches its payload: the broker has a whole frame to judge."""
    rng = random.Random(seed)
    base = msgpack.packb({"token": "gpb_000000000000_" + "x" * 43, "session": "ses_0123456789abcdef",
                          purpose: 1, "hello": 1, "compress": ["lz4"]})
    frames = []
    for i in range(n):
        data = bytearray(base)
        kind = i % 5
        if kind == 4:  # a key that is a list or a map (unhashable), the rest as it was
            data[1:1] = rng.choice([b"\x90", b"\x80", b"\x91\x01", b"\x81\x01\x02"]) + b"\xc0"
            data[0] += 1  # (one more entry in the map)
        elif kind == 0:
            for _ in range(rng.randint(1, 6)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind == 1:
            del data[rng.randrange(1, len(data)):]
        elif kind == 2:
            at = rng.randrange(len(data))
            data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        else:
            data = bytearray(rng.randbytes(rng.randint(1, 200)))
        frames.append(_raw(bytes(data)))
    return frames


def test_fuzzed_hellos_are_answered_or_closed_and_never_crash_the_front(broker: BrokerProcess) -> None:
    def attempt(path: str, frame: bytes) -> object:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(30)
            sock.connect(path)
            sock.sendall(frame)
            return _reply(sock)

    jobs = [(_path(broker), frame) for purpose in ("link", "segments") for frame in _mutations(21, 60, purpose)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda job: attempt(*job), jobs))
    for (path, frame), reply in zip(jobs, replies, strict=True):
        # Every whole frame gets an answer: a refusal saying why (none of these is a valid hello).
        assert reply is not None, (path, frame)
        assert _error(reply)["code"] in ("INVALID_ARGUMENT", "UNAUTHENTICATED", "NOT_FOUND"), (frame, reply)
    log = _log(broker)
    assert "Traceback" not in log, log[log.index("Traceback") - 500:][:3000]
    _copy_and_check(broker, "bob")


def _copy_and_check(broker: BrokerProcess, tenant: str) -> None:
    with connect(broker.target, token=broker.tokens[tenant]) as gpu:
        _shared_round_trip(gpu)


def _shared_round_trip(gpu: RemoteGpu) -> None:
    """A host array that is really shared memory (no fallback warning), copied to the device and back."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to plain memory would warn
        host = gpu.host_array(4096, np.float32)
    assert gpu._shm is not None and gpu._shm._arrays, "host_array fell back to plain memory"
    host[:] = np.arange(4096, dtype=np.float32)
    buf = gpu.allocate_memory(host.nbytes)
    gpu.copy_h2d(host, buf)
    back = gpu.host_array(4096, np.float32)
    gpu.copy_d2h(buf, back)
    np.testing.assert_array_equal(back, host)


def test_a_tenants_shared_memory_is_bounded_by_its_quota_across_sessions(broker: BrokerProcess) -> None:
    # Three sessions of alice (128 MiB quota) each ask for a 64 MiB host array: the third is past her shared
    # memory (which defaults to her quota), counted across all her sessions. (On plain links: a ring is shared
    # memory too, charged the same way, test_ring.py.)
    token = broker.tokens["alice"]
    with connect(broker.target, token=token, transport="link") as s1, \
            connect(broker.target, token=token, transport="link") as s2, \
            connect(broker.target, token=token, transport="link") as s3:
        a1 = s1.host_array(64 << 20)
        a2 = s2.host_array(64 << 20)
        with pytest.raises(ResourceExhausted) as info:
            s3.host_array(64 << 20)
        message = info.value.message
        assert "[tenants.alice] shared_memory" in message and "release segments" in message, message
        assert info.value.details["limit"] == QUOTA and info.value.details["used"] == QUOTA
        # The operator sees each tenant's own limit (bob's quota is the launcher's 2 GiB).
        with AdminClient(broker.target, broker.tokens["ops"]) as admin:
            limits = {row.tenant: row.shared_bytes_limit for row in admin.usage().tenants}
        assert limits["alice"] == QUOTA and limits.get("bob", 2 << 30) == 2 << 30, limits
        # What she holds works, and what she frees is hers again.
        a1[:16] = 7
        buf = s1.allocate_memory(16)
        s1.copy_h2d(a1[:16], buf)
        del a1, a2
        s2.close()
        _shared_round_trip(s3)


def _connections(path: str) -> int:
    """Connected sockets the broker accepted on ``path`` (from /proc/net/unix: state 03, the listener's path)."""
    count = 0
    for line in open("/proc/net/unix").read().splitlines()[1:]:  # noqa: SIM115 - read whole at once
        fields = line.split()
        if len(fields) >= 8 and fields[7] == path and fields[5] == "03":
            count += 1
    return count


def test_the_sdk_holds_no_unauthenticated_segments_channel(broker: BrokerProcess) -> None:
    # Small copies open no segments channel (they go as commands), and one says its hello at once.
    path = _path(broker)
    with connect(broker.target, token=broker.tokens["bob"]) as gpu:
        before = _connections(path)  # (the session's link among them)
        buf = gpu.allocate_memory(64)
        gpu.copy_h2d(np.zeros(16, dtype=np.float32), buf)
        assert _connections(path) == before, "a small copy opened a segments channel"
        gpu.host_array(16)
        assert gpu._shm is not None and gpu._shm._channel is not None and not gpu._shm._channel.closed
        assert _connections(path) == before + 1  # (answered, so authenticated: its constructor waits for it)


def test_silent_connections_from_the_tenants_uid_do_not_deny_it_shared_memory(broker: BrokerProcess) -> None:
    path = _path(broker)
    # A flood from the same uid (another tenant's process, or any process of that user): silent connections,
    # as many as the broker keeps for one uid before authentication (max_unauthenticated_per_uid, 64).
    flood: list[socket.socket] = []
    try:
        for _ in range(80):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            flood.append(sock)
            sock.connect(path)
        wait_for(lambda: _connections(path) >= 64, 10, "the broker to accept the flood")
        # Bob's new session still gets shared memory while the flood holds its uid's places.
        _copy_and_check(broker, "bob")
        assert sum(not peer_hung_up(sock) for sock in flood) >= 60, "the flood was gone before bob's turn"
    finally:
        for sock in flood:
            sock.close()


def test_one_tenants_idle_segment_connections_do_not_deny_another(broker: BrokerProcess) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < 1400:
        pytest.skip(f"needs 1400 descriptors, the hard limit is {hard}")
    path = _path(broker)
    held: list[socket.socket] = []
    refusals: list[dict[str, str]] = []
    try:
        with connect(broker.target, token=broker.tokens["mallory"]) as mallory:
            # Mallory authenticates 1,100 segment connections (a segments hello, answered: the connection stays
            # open) and leaves them idle.
            request = _frame({"token": broker.tokens["mallory"], "session": mallory.session, "segments": 1})
            for _ in range(1100):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(20)
                try:
                    sock.connect(path)
                    sock.sendall(request)
                    header = sock.recv(4)
                    reply = msgpack.unpackb(sock.recv(struct.unpack("!I", header)[0])) if len(header) == 4 else None
                except OSError:
                    reply = None
                if reply == [0, 0, {"segments": 1}]:
                    held.append(sock)
                    continue
                if isinstance(reply, list) and len(reply) == 3 and reply[1] == 1:
                    refusals.append(reply[2])
                sock.close()
            # Bob, another tenant, still gets shared memory.
            _copy_and_check(broker, "bob")
            # A new session of mallory's is refused shared memory: its host_array is plain memory, with a
            # warning saying so, and its copies still work (as commands).
            with connect(broker.target, token=broker.tokens["mallory"]) as late:
                with pytest.warns(RuntimeWarning, match="refused shared memory"):
                    plain = late.host_array(1024, np.float32)
                plain[:] = np.arange(1024, dtype=np.float32)
                buf = late.allocate_memory(plain.nbytes)
                late.copy_h2d(plain, buf)
                back = np.zeros_like(plain)
                late.copy_d2h(buf, back)
                np.testing.assert_array_equal(back, plain)
            # Mallory was held to her own cap, told which and what to do.
            assert len(held) == 64, len(held)
            assert refusals and refusals[0]["code"] == "RESOURCE_EXHAUSTED", refusals[:1]
            assert "max_shm_connections_per_tenant" in refusals[0]["message"]
            assert "tenant=mallory" in _log(broker)
    finally:
        for sock in held:
            with contextlib.suppress(OSError):
                sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert "Traceback" not in _log(broker)


def test_at_a_cap_a_new_connection_takes_an_idle_ones_place_never_a_talking_ones() -> None:
    # The gate alone (no broker): which connection makes room is what keeps a flood from denying a peer.
    gate = PreAuthGate(BrokerConfig(max_unauthenticated_connections=3, max_unauthenticated_per_uid=2))
    pairs = [socket.socketpair() for _ in range(5)]
    evicted: list[int] = []
    try:
        def admit(i: int) -> Ticket | None:
            ticket = gate.admit(peer_of(pairs[i][0], ""), "x")
            if ticket is not None:
                ticket.sock, ticket.evict = pairs[i][0], lambda: evicted.append(i)
            return ticket

        first, second = admit(0), admit(1)
        assert first is not None and second is not None
        pairs[0][1].sendall(b"\x00")  # the oldest has its hello on the way: not idle
        third = admit(2)  # takes the place of the idle one (1), not of the older, talking one (0)
        assert third is not None and evicted == [1] and not second.open and first.open
        assert gate.per_uid == {f"uid {os.getuid()}": 2} and gate.total == 2
        third.judging = True  # a hello being judged is not idle either
        assert admit(3) is None and gate.refusals == 2  # (the eviction was audited too)
        third.judging = False
        third.delaying = True  # sitting out a failure delay is
        assert admit(3) is not None and evicted == [1, 2] and gate.evictions == 2
        # A ticket with no way to end it (a TCP link's, today) is never evicted.
        gate = PreAuthGate(BrokerConfig(max_unauthenticated_connections=3, max_unauthenticated_per_uid=1))
        peer = peer_of(pairs[4][0], "")
        assert gate.admit(peer, "x") is not None and gate.admit(peer, "x") is None
    finally:
        for a, b in pairs:
            a.close()
            b.close()


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _one_reply(sock: socket.socket) -> object:
    """One answer frame, read exactly (the connection may go on)."""
    def exact(n: int) -> bytes:
        data = b""
        while len(data) < n:
            part = sock.recv(n - len(data))
            if not part:
                raise ConnectionError(f"closed after {len(data)} of {n} bytes")
            data += part
        return data
    (length,) = struct.unpack("!I", exact(4))
    return msgpack.unpackb(exact(length), raw=False)


@pytest.mark.parametrize("per_message", [4, 1])
def test_a_peer_cannot_make_the_front_hold_descriptors_sent_a_byte_at_a_time(broker: BrokerProcess,
                                                                               per_message: int) -> None:
    # Found in round 2: a Unix stream delivers each message that carries descriptors on its own, so a hello sent
    # one byte per message, each with descriptors, made the front hold all of them until the frame was whole
    # (4,001 for 1,000 messages of 4; a 64 KiB hello could be 262,144, past LimitNOFILE), unauthenticated. Four
    # per message is past what one message may carry, one within it: only their count over the frame tells.
    assert broker.process is not None
    front = broker.process.pid
    path = _path(broker)
    start = len(_log(broker))
    base = _descriptors(front)
    held = sent = 0
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(path)
            sock.sendall(b"\x00\x00\xff\xf0")  # a hello of 65,520 bytes is coming (within hello_max_bytes)
            refused_by_kernel = False
            try:
                for sent in range(1, 1001):
                    socket.send_fds(sock, [b"\x80"], [null] * per_message)
                    if sent % 50 == 0:
                        held = max(held, _descriptors(front) - base)
            except PermissionError:  # the socket takes no descriptor before its hello (SO_PASSRIGHTS = 0)
                refused_by_kernel = sent == 1
            except OSError:  # (the front hung up: it holds nothing of this peer's any more)
                pass
            if refused_by_kernel:
                assert PASSRIGHTS_SUPPORTED and _descriptors(front) - base <= 2
                return

            def settled() -> bool:  # the front has taken all it was sent, or hung up
                nonlocal held
                held = max(held, _descriptors(front) - base)
                return held >= per_message * sent or peer_hung_up(sock)

            with contextlib.suppress(AssertionError):
                wait_for(settled, 10, "the front to take the descriptors or hang up")
            print(f"\n{sent} one-byte messages with {per_message} descriptors each, unauthenticated: the front held "
                  f"at most {held} more descriptors ({base} before)")
            assert held <= DESCRIPTORS_PER_PEER, f"one unauthenticated connection made the front hold {held}"
            # Refused as a malformed hello is: answered, audited, after the failure delay; then closed.
            error = _error(_one_reply(sock))  # (then the end: a reset, as the front left what was sent unread)
            assert error["code"] == "INVALID_ARGUMENT" and "carries no file descriptor" in error["message"], error
    finally:
        os.close(null)
    wait_for(lambda: _descriptors(front) - base <= 2, 10, "the front to close the connection")
    log = _log(broker)[start:]
    assert "Traceback" not in log, log[log.index("Traceback") - 500:][:3000]
    # Audited: in full, or counted by the audit's rate limit (at the end of its window) when the module's earlier
    # refusals on this listener used up its budget.
    def audited() -> bool:
        log = _log(broker)[start:]
        return bool((f"peer=unix:{path}" in log and "reason=malformed hello: a link hello carries no file "
                     "descriptor" in log) or re.search(rf"pre-auth refusals on unix:{re.escape(path)}: \d+ more", log))

    wait_for(audited, 15, "the refusal to be audited")
    _copy_and_check(broker, "bob")


def test_a_request_with_a_second_descriptor_ends_its_authenticated_connection(broker: BrokerProcess) -> None:
    # After its hello, a tenant's connection sends a registration with one segment on its first byte and another
    # on the rest: refused, audited with its tenant, the connection ended, neither descriptor kept.
    assert broker.process is not None
    token = broker.tokens["bob"]
    start = len(_log(broker))
    with connect(broker.target, token=token) as gpu, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        base = _descriptors(broker.process.pid)
        sock.settimeout(20)
        sock.connect(_path(broker))
        sock.sendall(_frame({"segments": 1, "session": gpu.session, "token": token}))
        assert _one_reply(sock) == [0, 0, {"segments": 1}]
        frame = _frame(["register", "two-fds", 4096])
        segments = [create_segment_fd(4096), create_segment_fd(4096)]
        try:
            socket.send_fds(sock, [frame[:1]], segments[:1])
            socket.send_fds(sock, [frame[1:]], segments[1:])
        finally:
            for fd in segments:
                os.close(fd)
        error = _error(_one_reply(sock))
        assert error["code"] == "INVALID_ARGUMENT" and "at most 1 file descriptor" in error["message"], error
        sock.settimeout(5)
        try:
            ended = sock.recv(1) == b""
        except ConnectionResetError:  # (the front left the rest of the frame unread: the end comes as a reset)
            ended = True
        except TimeoutError:
            ended = False
        assert ended, "the connection went on"
        wait_for(lambda: _descriptors(broker.process.pid if broker.process else 0) <= base, 10,
                 "the front to close the connection and both descriptors")
        _shared_round_trip(gpu)  # the tenant's own segments channel serves on
    log = _log(broker)[start:]
    assert "Traceback" not in log, log[log.index("Traceback") - 500:][:3000]
    assert "tenant=bob reason=a segment request carries at most 1 file descriptor" in log, log[-3000:]


def test_a_front_out_of_descriptors_answers_unavailable_and_charges_no_device(broker: BrokerProcess) -> None:
    # The front at its descriptor limit (what the hoard above could do; many clients can too): a session that needs
    # a new worker (its socketpairs and pipes) fails. Found in round 2: INTERNAL with a traceback in the log. Now
    # UNAVAILABLE with a retry hint, one log line, and the device is not charged for it: past
    # device_failure_threshold (3) such failures it would stop serving everyone for a minute.
    assert broker.process is not None
    front = broker.process.pid
    start = len(_log(broker))
    channel, metadata = make_channel(broker.target, broker.tokens["dora"])
    with channel:
        grpc.channel_ready_future(channel).result(timeout=30)  # (connected now: later no descriptor is needed)
        stub = pb_grpc.GpuBrokerStub(channel)
        limits = resource.prlimit(front, resource.RLIMIT_NOFILE)
        taken = {int(name) for name in os.listdir(f"/proc/{front}/fd")}
        lowest_free = next(n for n in itertools.count() if n not in taken)
        errors: list[grpc.RpcError] = []
        resource.prlimit(front, resource.RLIMIT_NOFILE, (lowest_free, limits[1]))  # no descriptor left
        try:
            for _ in range(4):
                try:
                    stub.OpenSession(pb.OpenSessionRequest(device=0), metadata=metadata, timeout=30)
                except grpc.RpcError as exc:
                    errors.append(exc)
        finally:
            resource.prlimit(front, resource.RLIMIT_NOFILE, limits)
        assert len(errors) == 4, "a session opened with no descriptor left"
        for exc in errors:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, (exc.code(), exc.details())
            assert "out of file descriptors" in (exc.details() or ""), exc.details()
        # Descriptors free again: the device serves (it was not taken out of service for the front's condition).
        session = stub.OpenSession(pb.OpenSessionRequest(device=0), metadata=metadata, timeout=60).session
        stub.CloseSession(pb.SessionRequest(session=session), metadata=metadata, timeout=60)
    log = _log(broker)[start:]
    assert "Traceback" not in log, log[log.index("Traceback") - 500:][:3000]
    assert "out of file descriptors" in log, log[-3000:]


# Found in round 3 (attack3): a segment that holds more than it was charged for. The front charged (per session,
# per tenant) the size a registration announced, and checked only that the memfd was sealed against shrinking and
# at least that long. A sparse memfd far larger than announced (ftruncate costs its client nothing), or one not
# sealed against growing and grown after the check, was every page the worker's to fill: a kernel maps the whole
# file through a second mapping of the worker's (``mremap(addr, 0, window, MREMAP_MAYMOVE)``), slides that window
# over it and populates it (``MADV_POPULATE_WRITE``), unmapping as it goes, so that no rlimit of the worker counts
# the pages (shared: not RLIMIT_DATA; never more than two windows of RLIMIT_AS) and no quota does either.
SEGMENT_ANNOUNCED = 4096
SEGMENT_FILE = 256 << 20  # what the worker could fill: 64 Ki times what mallory is charged for
FILL_WINDOW = 32 << 20
FILL_SOURCE = SYSCALL_SOURCE + r"""
#define SYS_MREMAP 25
#define SYS_MADVISE 28
#define SYS_MUNMAP 11
#define MREMAP_MAYMOVE 1
#define MADV_POPULATE_WRITE 23
__kernel void gpb_fill(const ulong addr, const ulong total, const ulong window, __global long* res) {
    long w = (long)window;
    long m = sys6(SYS_MREMAP, (long)addr, 0, w, MREMAP_MAYMOVE, 0, 0);  /* a second mapping of the same pages */
    res[0] = m;
    if (m < 0) return;
    long r = sys6(SYS_MADVISE, m, w, MADV_POPULATE_WRITE, 0, 0, 0);
    res[1] = r;
    if (r < 0) { sys6(SYS_MUNMAP, m, w, 0, 0, 0, 0); return; }
    ulong done = window;
    while (done + window <= total) {
        long m2 = sys6(SYS_MREMAP, m, w, 2 * w, MREMAP_MAYMOVE, 0, 0);  /* grow by a window */
        if (m2 < 0) { res[2] = m2; break; }
        r = sys6(SYS_MADVISE, m2 + w, w, MADV_POPULATE_WRITE, 0, 0, 0);
        sys6(SYS_MUNMAP, m2, w, 0, 0, 0, 0);  /* drop the front window: the pages stay in the memfd */
        m = m2 + w;
        if (r < 0) { res[3] = r; break; }
        done += window;
    }
    sys6(SYS_MUNMAP, m, w, 0, 0, 0, 0);
    res[4] = (long)done;
}
"""


def _worker_maps(broker: BrokerProcess, tenant: str, name: str) -> list[str]:
    """The lines of ``tenant``'s workers' /proc/PID/maps that map the memfd called ``name``."""
    lines = []
    for pid in worker_pids(broker, tenant):
        with contextlib.suppress(OSError):
            lines += [line for line in open(f"/proc/{pid}/maps").read().splitlines()  # noqa: SIM115
                      if f"/memfd:{name} " in line + " "]
    return lines


def _fill_from_the_worker(broker: BrokerProcess, gpu: RemoteGpu, name: str) -> list[int]:
    """The attack's second half, once a segment is registered: a kernel of the worker fills the whole memfd."""
    check_arch()
    lines = _worker_maps(broker, "mallory", name)  # (an attacker reads its own /proc/self/maps)
    assert lines, "the worker did not map the segment"
    address = int(lines[0].split("-", 1)[0], 16)
    kernel = gpu.get_kernel(gpu.load_module(FILL_SOURCE, ModuleFormat.OPENCL_C), "gpb_fill")
    res = gpu.allocate_memory(8 * 8)
    gpu.copy_h2d(np.zeros(8, dtype=np.int64), res)
    gpu.execute_kernel(kernel, 1, 1, [np.uint64(address), np.uint64(SEGMENT_FILE), np.uint64(FILL_WINDOW), res])
    gpu.synchronize()
    out = np.empty(8, dtype=np.int64)
    gpu.copy_d2h(res, out)
    return [int(v) for v in out]


@pytest.mark.parametrize("attack", ["larger-than-announced", "growable"])
def test_a_segment_holding_more_than_it_announces_is_refused(broker: BrokerProcess, backend: str,
                                                             attack: str) -> None:
    # larger-than-announced: a sparse 256 MiB memfd, sealed as the SDK seals, announced as 4 KiB.
    # growable: a 4 KiB memfd sealed against shrinking only, grown to 256 MiB once registered.
    name = f"attack3-{attack}"
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    start = len(_log(broker))
    try:
        if attack == "larger-than-announced":
            os.ftruncate(fd, SEGMENT_FILE)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        else:
            os.ftruncate(fd, SEGMENT_ANNOUNCED)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
        token = broker.tokens["mallory"]
        with connect(broker.target, token=token, timeout=60) as gpu:
            channel = SegmentChannel(_path(broker), token, gpu.session)
            try:
                try:
                    channel.register(fd, SEGMENT_ANNOUNCED, name)
                except InvalidArgument as exc:
                    refusal = exc.message
                else:  # the hole: the attack goes on, to show what the worker makes of it
                    if attack == "growable":
                        os.ftruncate(fd, SEGMENT_FILE)
                    results = _fill_from_the_worker(broker, gpu, name) if backend == "opencl" else []
                    held = os.fstat(fd).st_blocks * 512  # the client never touched a page
                    channel.release(name)
                    pytest.fail(f"a segment announced (and charged) as {SEGMENT_ANNOUNCED} bytes was registered; "
                                f"the worker's kernel then filled {held >> 20} MiB of host memory with it "
                                f"(kernel results {results})")
                assert "F_SEAL_GROW" in refusal if attack == "growable" else "not the 4096 announced" in refusal, (
                    refusal)
                assert "create_segment_fd" in refusal or "ftruncate" in refusal, refusal  # (what to do)
                # Nothing mapped in the worker, nothing populated; the refusal is audited with the tenant.
                assert not _worker_maps(broker, "mallory", name)
                assert os.fstat(fd).st_blocks == 0
                log = _log(broker)[start:]
                assert "Traceback" not in log, log[log.index("Traceback") - 500:][:3000]
                assert f"tenant=mallory reason={refusal}" in log, log[-3000:]
                # The same connection registers a segment made as the SDK makes it (exactly its size, sealed).
                good = create_segment_fd(SEGMENT_ANNOUNCED)
                try:
                    assert channel.register(good, SEGMENT_ANNOUNCED, name) == name
                finally:
                    os.close(good)
                channel.release(name)
            finally:
                channel.close()
            _shared_round_trip(gpu)
    finally:
        os.close(fd)
