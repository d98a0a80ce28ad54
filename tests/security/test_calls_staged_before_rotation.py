"""A gRPC call staged before its token is rotated (or its tenant removed) ends at the reload, its place among the
tenant's calls in flight given back: it never runs with the revoked credential.

A call authenticates before its request message is read (``_status._admit``), and its holder may send the message
as slowly as it likes: HEADERS with the token, the request one byte short. Before the fix, nothing looked at the
call again: whoever held a leaked token staged calls, waited for the operator to rotate it, then sent the last byte
of each, and each ran as the tenant (Allocate allocated in bob's session, OpenSession opened one), while a fresh call
with the old token got UNAUTHENTICATED; the staged calls also kept the tenant's ``max_inflight_per_tenant`` places,
so the tenant's own calls with its new token were refused (0 of 5 served with 4 staged); and a call staged by a
tenant then removed was refused only after the front had started a worker for it. Now every call is watched from
its authentication to its end (``Revocations``): a reload that revokes its credential cancels it (UNAUTHENTICATED)
and gives its place back at once, its credential is checked again once its message is read, and the message must
arrive within ``request_message_timeout_seconds`` (``test_grpc_partial_messages.py``).
"""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing

import grpc
import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import (
    AdminClient,
    GpuBrokerError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    connect,
)
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc

from ..helpers import wait_for

INFLIGHT = 4
ENDED_WITHIN = 5.0  # seconds after the reload returns: the front ends a revoked call at once (a loaded CI machine)


def _frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([ftype, flags]) + struct.pack(">I", sid) + payload


def _literal(name: str, value: str) -> bytes:  # an HPACK literal field, not indexed, no Huffman coding
    n, v = name.encode(), value.encode()
    assert len(n) < 127 and len(v) < 127
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


class Staged:
    """A gRPC call on a connection of its own, its request message sent up to one byte short of complete."""

    def __init__(self, path: str, method: str, token: str, message: bytes) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(path)
        self.sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0))
        fields = [(":method", "POST"), (":scheme", "http"), (":path", method), (":authority", "localhost"),
                  ("content-type", "application/grpc"), ("te", "trailers"), ("authorization", "Bearer " + token)]
        body = b"\x00" + struct.pack(">I", len(message)) + message
        self.last = body[-1:]
        self.sock.sendall(_frame(1, 0x4, 1, b"".join(_literal(k, v) for k, v in fields)) + _frame(0, 0, 1, body[:-1]))
        self.buf, self.answered, self.trailers = b"", False, b""

    def ended(self, timeout: float) -> bool:
        """Whether the broker ends the call within ``timeout`` seconds, its message still one byte short."""
        self._read(time.monotonic() + timeout)
        return bool(self.trailers)

    def finish(self) -> bool:
        """Send the last byte (if the call is still open); whether the call answered with a message (it ran)."""
        if not self.trailers:
            self.sock.sendall(_frame(0, 1, 1, self.last))
            self._read(time.monotonic() + 15)
        return self.answered

    def _read(self, deadline: float) -> None:
        """Read the connection until the call's trailers come, the connection ends, or the deadline."""
        while not self.trailers and (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(65536)
            except OSError:  # (a timeout; the broker closed the connection: no trailers either way)
                return
            if not data:
                return
            self.buf += data
            while len(self.buf) >= 9 and len(self.buf) >= 9 + int.from_bytes(self.buf[:3], "big"):
                n, ftype, flags = int.from_bytes(self.buf[:3], "big"), self.buf[3], self.buf[4]
                sid = int.from_bytes(self.buf[5:9], "big") & 0x7FFFFFFF
                payload, self.buf = self.buf[9:9 + n], self.buf[9 + n:]
                if ftype in (4, 6) and not flags & 1:  # SETTINGS and PING, acknowledged
                    try:
                        self.sock.sendall(_frame(ftype, 1, 0, payload if ftype == 6 else b""))
                    except OSError:
                        return
                elif ftype == 0 and sid == 1 and n > 5:
                    self.answered = True
                elif ftype == 1 and sid == 1 and flags & 1:
                    self.trailers = payload or b"-"

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    tmp = tmp_path_factory.mktemp("staged")
    tenants = [TenantSpec("ops", admin=True), TenantSpec("bob"), TenantSpec("carol"), TenantSpec("dave")]
    with BrokerProcess(tenants, backend="opencl", settings={"cache_dir": str(tmp / "caches"),
                                                            "max_inflight_per_tenant": INFLIGHT}) as proc:
        yield proc


def _reconfigure(broker: BrokerProcess, action: str, tenant: str) -> str:
    """``gpubroker tenant <action> <tenant>`` then an admin reload; the command's last line (a new token)."""
    out = subprocess.run([sys.executable, "-m", "gpubroker.broker.cli", "tenant", action, tenant, "--config",
                          str(broker.config_path)], capture_output=True, text=True, check=True).stdout
    with AdminClient(broker.target, broker.tokens["ops"]) as admin:
        admin.reload()
    return out.strip().splitlines()[-1]


def _rotate(broker: BrokerProcess, tenant: str) -> str:
    return _reconfigure(broker, "rotate-token", tenant)


def _stage(broker: BrokerProcess, token: str, calls: list[tuple[str, bytes]]) -> list[Staged]:
    """Stage ``calls`` (method, request), then fill the tenant's other places among its calls in flight with staged
    ListDevices calls, and wait until every staged call has authenticated: a call of the tenant's is refused while
    none of them is. (One refused because the probe, or a client's heartbeat, held a place as it authenticated is
    staged again.)"""
    path = broker.target.removeprefix("unix:")
    fillers = [("/gpubroker.v1.GpuBroker/ListDevices", pb.ListDevicesRequest().SerializeToString())]
    specs = calls + fillers * (INFLIGHT - len(calls))
    staged = [Staged(path, method, token, message) for method, message in specs]
    channel = grpc.secure_channel(broker.target, grpc.local_channel_credentials(grpc.LocalConnectionType.UDS),
                                  options=[("grpc.use_local_subchannel_pool", 1)])
    with closing(channel):
        stub = pb_grpc.GpuBrokerStub(channel)

        def all_held() -> bool:
            for i, call in enumerate(staged):
                if call.ended(0.01):
                    call.close()
                    staged[i] = Staged(path, specs[i][0], token, specs[i][1])
            try:
                stub.ListDevices(pb.ListDevicesRequest(), metadata=[("authorization", f"Bearer {token}")], timeout=10)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                return not any(call.ended(0.01) for call in staged)
            return False

        wait_for(all_held, 20, "the staged calls to authenticate")
    return staged


def _refused_as_revoked(broker: BrokerProcess, token: str) -> None:
    """A fresh session with ``token`` is refused UNAUTHENTICATED. (A connection the front closed as it was made, on
    a loaded machine, is tried again, as a client does with UNAVAILABLE: once it reaches gRPC, the token decides.)"""
    for attempt in range(3):
        try:
            with pytest.raises(Unauthenticated):
                connect(broker.target, token=token, transport="grpc", shared_memory=False)
            return
        except Unavailable:
            if attempt == 2:
                raise


def _no_traceback(broker: BrokerProcess) -> None:
    log = broker.log_tail(1_000_000)
    assert "Traceback" not in log, log[log.index("Traceback") - 500:][:3000]


def test_a_call_staged_before_a_rotation_does_not_run_with_the_revoked_token(broker: BrokerProcess) -> None:
    old = broker.tokens["bob"]
    gpu = connect(broker.target, token=old, transport="grpc", shared_memory=False)  # (left open: its session lives)
    staged = _stage(broker, old, [
        ("/gpubroker.v1.GpuBroker/Allocate", pb.AllocateRequest(session=gpu.session, size=4096).SerializeToString()),
        ("/gpubroker.v1.GpuBroker/OpenSession", pb.OpenSessionRequest(device=0).SerializeToString())])
    allocate, open_session = staged[:2]
    try:
        _rotate(broker, "bob")
        ended = [call.ended(ENDED_WITHIN) for call in staged]
        _refused_as_revoked(broker, old)
        allocated = allocate.finish()
        opened = open_session.finish()
    finally:
        for call in staged:
            call.close()
    print(f"\nafter bob's token was rotated, calls staged with it before: Allocate ran: {allocated}; "
          f"OpenSession ran: {opened}; ended by the reload: {ended}")
    assert not allocated and not opened, "calls authenticated before the rotation ran after it with the revoked token"
    assert all(ended), f"staged calls of a revoked token were still open {ENDED_WITHIN} s after the reload"
    _no_traceback(broker)


def test_a_call_staged_by_a_removed_tenant_starts_no_worker(broker: BrokerProcess) -> None:
    staged = _stage(broker, broker.tokens["carol"], [
        ("/gpubroker.v1.GpuBroker/OpenSession", pb.OpenSessionRequest(device=0).SerializeToString())])
    try:
        _reconfigure(broker, "remove", "carol")
        ended = all(call.ended(ENDED_WITHIN) for call in staged)
        opened = staged[0].finish()
    finally:
        for call in staged:
            call.close()
    started = "worker for tenant carol" in broker.log_tail(1_000_000)
    print(f"\ncarol removed with an OpenSession of hers staged: it ran: {opened}; ended by the reload: {ended}; a "
          f"worker started for her: {started}")
    assert not opened and not started, "a call staged by a removed tenant started a worker for it"
    assert ended, f"a staged call of a removed tenant was still open {ENDED_WITHIN} s after the reload"
    _no_traceback(broker)


def test_calls_staged_with_a_revoked_token_cannot_hold_the_tenants_places(broker: BrokerProcess) -> None:
    staged = _stage(broker, broker.tokens["dave"],
                    [("/gpubroker.v1.GpuBroker/OpenSession", pb.OpenSessionRequest(device=0).SerializeToString())] *
                    INFLIGHT)
    try:
        new = _rotate(broker, "dave")
        served, errors = 0, []
        for _ in range(5):
            try:
                with connect(broker.target, token=new, transport="grpc", shared_memory=False, timeout=10) as gpu:
                    gpu.free_memory(gpu.allocate_memory(16))
                    served += 1
            except (ResourceExhausted, GpuBrokerError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            time.sleep(0.2)
    finally:
        for call in staged:
            call.close()
    print(f"\nwith {INFLIGHT} calls staged by dave's revoked token, his calls with the new token: {served} of 5 "
          f"served; {errors[:1]}")
    assert served == 5, f"calls of a revoked token hold the tenant's places: {errors[:1]}"
    _no_traceback(broker)
