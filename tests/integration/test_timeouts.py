"""Timeouts: a call past its deadline fails and leaves its client usable; the broker drops a client gone silent.

Every client call carries a deadline; long-lived calls rely on HTTP/2 keepalive (see docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.broker.config import BrokerConfig, TenantConfig
from gpubroker.broker.front import _server
from gpubroker.broker.front.auth import mint_token
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import DeadlineExceeded, connect

from ..conftest import worker_pids
from ..helpers import wait_for

CLIENT = str(Path(__file__).with_name("killable_client.py"))


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_call_past_its_deadline_raises_deadline_exceeded_and_the_next_calls_get_their_own_answers(
        backend: str) -> None:
    """Bob's synchronize waits for the device behind Alice's endless kernel until its deadline. Its answer could
    still come later: it must be read as that batch's, never as his next call's (the connection stays: acks name
    their batch)."""
    with BrokerProcess([TenantSpec("alice"), TenantSpec("bob")], backend=backend) as broker, \
            connect(broker.target, token=broker.tokens["alice"]) as alice, \
            connect(broker.target, token=broker.tokens["bob"], timeout=2.0) as bob:
        buf = bob.allocate_memory(64)
        spin = alice.compile_kernel(samples.source(backend), "spin")
        alice.execute_kernel(spin, 1, 1, [alice.allocate_memory(4096), np.int64(1 << 40)])
        with pytest.raises(DeadlineExceeded):
            bob.synchronize()  # (on the link to his worker, which waits for a turn on the device)
        with pytest.raises(DeadlineExceeded):
            bob.synchronize()  # (the same link, the first sync still unanswered ahead of this one)
        (pid,) = worker_pids(broker, "alice")
        os.kill(pid, signal.SIGKILL)  # the device is free again
        bob.memset(buf, 9)
        out = bytearray(64)
        bob.copy_d2h(buf, out)
        assert out == b"\x09" * 64
        bob.synchronize()


@pytest.fixture
def quick_keepalive_broker(backend: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str, _server.Broker]]:
    """A broker in this process (so the test can see its sessions) that pings clients after 1 s of silence."""
    monkeypatch.setattr(_server, "KEEPALIVE_TIME_MS", 1000)
    monkeypatch.setattr(_server, "KEEPALIVE_TIMEOUT_MS", 1000)
    workdir = tempfile.mkdtemp(prefix="gpb-", dir="/tmp")
    token = mint_token()
    config = BrokerConfig(listen=[f"unix:{workdir}/broker.sock"], backend=backend, lease_seconds=120.0,
                          drain_grace_seconds=0.0)
    config.add_tenant(TenantConfig("alice", token.token_id, token.token_hash, 1 << 30))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    broker = _server.Broker(config)
    try:
        asyncio.run_coroutine_threadsafe(broker.start(), loop).result(120)
        yield config.listen[0], token.token, broker
    finally:
        asyncio.run_coroutine_threadsafe(broker.stop(0), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_keepalive_drops_a_client_that_stopped_answering(quick_keepalive_broker: tuple[str, str, _server.Broker]
                                                         ) -> None:
    """A client process that is alive but silent (stopped, as a paused VM or a vanished host) holds a copy open:
    the broker's keepalive ping goes unanswered and it drops the connection, long before the session's lease ends."""
    target, token, broker = quick_keepalive_broker
    assert broker.sessions is not None
    child = subprocess.Popen([sys.executable, CLIENT, target, token, "stall"], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        session = broker.sessions.sessions[child.stdout.readline().decode().strip()]
        wait_for(lambda: session.inflight == 1, 10, "the upload to be under way")
        wait_for(lambda: _state(child.pid) == "T", 10, "the client to stop")
        wait_for(lambda: session.inflight == 0, 30, "the broker to drop the silent client's upload")
        assert broker.sessions.sessions.get(session.id) is session  # the lease did not end it: the ping did
    finally:
        child.kill()
        child.wait()
