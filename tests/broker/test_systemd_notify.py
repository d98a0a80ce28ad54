"""sd_notify: a real broker tells a stand-in service manager READY, WATCHDOG and STOPPING."""

from __future__ import annotations

import os
import signal
import socket
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpubroker.broker.front import _systemd
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import connect

TIMEOUT = 20.0


@pytest.fixture
def manager() -> Iterator[socket.socket]:
    """A datagram socket standing in for systemd's notify socket; it learns each sender's pid (SCM_CREDENTIALS)."""
    workdir = Path(tempfile.mkdtemp(prefix="gpb-n-", dir="/tmp"))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    sock.bind(str(workdir / "notify"))
    yield sock
    sock.close()
    (workdir / "notify").unlink()
    workdir.rmdir()


def receive_until(sock: socket.socket, wanted: str, timeout: float = TIMEOUT) -> list[tuple[int, list[str]]]:
    """Messages (sender pid, states) up to and including the first holding ``wanted``; fails after ``timeout``."""
    messages: list[tuple[int, list[str]]] = []
    deadline = time.monotonic() + timeout
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("3i")))
        except TimeoutError:
            raise AssertionError(f"no {wanted} within {timeout} s; got {messages}") from None
        pid = next(struct.unpack("3i", d[:12])[0] for level, kind, d in ancillary
                   if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS)
        messages.append((pid, data.decode().split("\n")))
        if wanted in messages[-1][1]:
            return messages


def test_broker_notifies_ready_watchdog_and_stopping(manager: socket.socket) -> None:
    env = {"NOTIFY_SOCKET": manager.getsockname(), "WATCHDOG_USEC": "200000"}
    with BrokerProcess([TenantSpec("alice")], backend="opencl", settings={"drain_grace_seconds": 60.0},
                       env=env) as broker:
        assert broker.process is not None
        ready = receive_until(manager, "READY=1")
        assert len(ready) == 1, f"something came before READY=1: {ready}"
        pid, states = ready[0]
        # NotifyAccess=main: systemd drops messages from any process but the one it started.
        assert pid == broker.process.pid
        assert f"STATUS=serving on {broker.target}" in states
        assert receive_until(manager, "WATCHDOG=1")[-1][0] == broker.process.pid
        with connect(broker.target, token=broker.tokens["alice"]):
            broker.process.send_signal(signal.SIGTERM)
            stopping = receive_until(manager, "STOPPING=1")
            assert all(states == ["WATCHDOG=1"] for _, states in stopping[:-1]), stopping
            assert stopping[-1] == (broker.process.pid, ["STOPPING=1"])
            # Our open session keeps the broker draining; the pings go on meanwhile (a drain may outlast
            # WatchdogSec).
            assert receive_until(manager, "WATCHDOG=1")[-1] == (broker.process.pid, ["WATCHDOG=1"])
            assert broker.process.poll() is None
        # The session closed: the drain ends and the broker exits cleanly.
        assert broker.process.wait(TIMEOUT) == 0


def test_notify_reaches_an_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"gpb-notify-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert _systemd.notify("READY=1", "STATUS=x")
        sock.settimeout(TIMEOUT)
        assert sock.recv(4096) == b"READY=1\nSTATUS=x"


def test_notify_without_a_manager_sends_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not _systemd.notify("READY=1")
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:9999")  # systemd >= 254's VM form, which we do not speak
    assert not _systemd.notify("READY=1")


@pytest.mark.parametrize(("usec", "pid", "interval"), [
    ("30000000", None, 15.0),  # half of WatchdogSec=30s
    ("30000000", "self", 15.0),
    ("30000000", "1", None),  # meant for another process: a parent that passed its environment on
    (None, None, None),
    ("0", None, None),
    ("soon", None, None),
])
def test_watchdog_interval(monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None,
                           interval: float | None) -> None:
    for key, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", str(os.getpid()) if pid == "self" else pid)):
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    assert _systemd.watchdog_interval() == interval


