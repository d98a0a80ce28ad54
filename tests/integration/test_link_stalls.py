"""A link's client that stalls (half a frame sent, or its acks never read) holds nothing but its own link.

The worker serves every session of its tenant on the device, and may hold the tenant's turn on it, which other
tenants wait for: a blocking read of a half frame, or a blocking write of an ack nobody reads, would freeze them
all for the link timeout. Raw Unix-socket clients do the stalling; real clients (the same session's own link,
another session of the same tenant, another tenant) must meanwhile get their answers at once, and the stalled
links are dropped (the worker closes them: POLLHUP on our end, whatever we left unread).
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from gpubroker.broker.launcher import BrokerProcess
from gpubroker.broker.worker._links import DEFAULT_MAX_FRAME
from gpubroker.client import RemoteGpu, connect
from gpubroker.wire.commands import Batch, Read, Synchronize, decode_ack, encode
from gpubroker.wire.frames import recv_payload, send_frame, send_payload

from ..helpers import wait_for

# The worker's link timeout is 10 s (src/gpubroker/broker/worker/_links.py): every answer here must come well before it.
PROMPT = 4.0
LINK_TIMEOUT = 10.0
_HEADER = struct.Struct("!I")


def _raw_link(broker: BrokerProcess, token: str, session: str) -> socket.socket:
    """A link whose hello the worker answered, driven by hand."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(broker.target.removeprefix("unix:") + ".fast")
    send_frame(sock, {"token": token, "session": session, "link": 1})
    recv_payload(sock, 1 << 16)  # the worker's hello reply
    return sock


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the worker closed its end (reported even while our receive queue still holds its acks)."""
    poller = select.poll()
    poller.register(sock, select.POLLHUP | select.POLLRDHUP)
    return bool(poller.poll(0))


def _prompt(gpus: list[RemoteGpu], what: str) -> None:
    """Each client's round trip through its worker is answered well within the link timeout."""
    for gpu in gpus:
        start = time.monotonic()
        buf = gpu.allocate_memory(4096)
        gpu.memset(buf, 7)
        gpu.synchronize()
        gpu.free_memory(buf)
        took = time.monotonic() - start
        assert took < PROMPT, f"{what}: a round trip took {took:.1f} s"


@pytest.fixture
def clients(broker: BrokerProcess) -> Iterator[tuple[RemoteGpu, RemoteGpu, RemoteGpu]]:
    """Two sessions of alice's on device 0 (one worker serves both) and one of bob's on the same device."""
    with connect(broker.target, token=broker.tokens["alice"], device=0) as one, \
            connect(broker.target, token=broker.tokens["alice"], device=0) as two, \
            connect(broker.target, token=broker.tokens["bob"], device=0) as bob:
        yield one, two, bob


def test_a_half_sent_frame_holds_no_one_and_its_link_is_dropped(
        broker: BrokerProcess, clients: tuple[RemoteGpu, RemoteGpu, RemoteGpu]) -> None:
    one, two, bob = clients
    token = broker.tokens["alice"]
    frame = _HEADER.pack(64) + encode(Batch(1, 1, [Synchronize()])).ljust(64, b"\x00")
    _prompt([one], "before")  # alice's worker has just had the device: it may still hold her turn
    stalled = []
    for cut in (2, 4, 20):  # half a header, a header alone, a header and part of its payload
        sock = _raw_link(broker, token, one.session)
        sock.sendall(frame[:cut])
        stalled.append(sock)
    _prompt([one, two, bob], "while three links stall mid-frame")
    _prompt([bob, one], "bob first, alice's turn revoked while her links stall")
    wait_for(lambda: all(_closed_by_peer(s) for s in stalled), LINK_TIMEOUT + 5, "the stalled links to be dropped")
    for sock in stalled:
        assert sock.recv(1) == b""  # dropped unanswered: no frame of theirs was whole
        sock.close()
    _prompt([one, two, bob], "after")


def test_a_client_that_never_reads_its_acks_holds_no_one(
        broker: BrokerProcess, clients: tuple[RemoteGpu, RemoteGpu, RemoteGpu]) -> None:
    one, two, bob = clients
    token = broker.tokens["alice"]
    chunk = 64 * 1024
    buf = one.allocate_memory(chunk)
    one.synchronize()
    read = encode(Batch(1, 1, [Read((buf.handle, 0), 0, chunk)]))
    frame = _HEADER.pack(len(read)) + read
    # A flood: far more acks than the link's outbox may hold (16 of its largest frames), never read.
    flood = _raw_link(broker, token, one.session)
    flooding = (16 * DEFAULT_MAX_FRAME) // chunk * 2

    def send_flood() -> None:
        try:
            for _ in range(flooding):
                flood.sendall(frame)
        except OSError:
            pass  # dropped mid-flood: what this test waits for

    sender = threading.Thread(target=send_flood, daemon=True)
    sender.start()
    # A trickle: acks far past what the socket buffers (yet within the outbox's bound), never read: its outbox
    # stays, and does not move.
    trickle = _raw_link(broker, token, one.session)
    trickle.sendall(frame * 200)
    _prompt([one, two, bob], "while two links do not read their acks")
    wait_for(lambda: _closed_by_peer(flood), LINK_TIMEOUT, "the flooding link to be dropped")
    sender.join(LINK_TIMEOUT)
    assert not sender.is_alive()
    _prompt([one, two, bob], "after the flood")
    wait_for(lambda: _closed_by_peer(trickle), LINK_TIMEOUT + 5, "the link whose acks wait to be dropped")
    for sock in (flood, trickle):
        sock.close()
    _prompt([one, two, bob], "after")


def test_acks_a_slow_reader_has_not_taken_wait_in_order(
        broker: BrokerProcess, clients: tuple[RemoteGpu, RemoteGpu, RemoteGpu]) -> None:
    """Acks past what the socket buffers wait in the link's outbox and go out in order once the client reads."""
    one, two, bob = clients
    chunk, count = 64 * 1024, 100  # 6 MiB of acks: far more than a socket buffers
    buf = one.allocate_memory(chunk)
    one.memset(buf, 0x5A)
    one.synchronize()
    sock = _raw_link(broker, broker.tokens["alice"], one.session)
    for k in range(1, count + 1):
        send_payload(sock, encode(Batch(k, k, [Read((buf.handle, 0), 0, chunk)])))
    _prompt([one, two, bob], "while a link's acks wait for its client")
    for k in range(1, count + 1):
        ack = decode_ack(recv_payload(sock, DEFAULT_MAX_FRAME))
        assert (ack.id, ack.done, ack.error) == (k, 1, None)
        assert ack.result == b"\x5a" * chunk
    send_payload(sock, encode(Batch(count + 1, count + 1, [Synchronize()])))
    assert decode_ack(recv_payload(sock, DEFAULT_MAX_FRAME)).id == count + 1  # the link lived through it
    sock.close()
