"""The one batching core and the framed link, against a scripted peer on a real socketpair: order, the window,
deferred errors naming the command, results, lost links, timeouts, and the choice of transport at connect.

The peer speaks the protocol (src/gpubroker/wire/commands.py) and stands in for the front's hello and the worker's acks;
it runs no device work (the integration suite does that against real brokers)."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpubroker.client import DeadlineExceeded, GpuBrokerError, InvalidArgument, NotFound, Unauthenticated, Unavailable
from gpubroker.client._transports import (
    BatchingTransport,
    Carrier,
    FramedSocket,
    GrpcStream,
    RingUpgrade,
    _core,
    choose_transport,
    framed_link,
    split_host_port,
    unix_connector,
)
from gpubroker.wire.commands import (
    Ack,
    Batch,
    CommandError,
    Launch,
    Memset,
    Read,
    ScalarArg,
    Synchronize,
    Write,
    decode_batch,
    encode,
)
from gpubroker.wire.errors import WireError
from gpubroker.wire.frames import recv_frame, recv_payload, send_frame, send_payload

MAX_FRAME = 1 << 20
Handler = Callable[[Batch], Ack | None]  # None: close the connection instead of answering


class Peer:
    """One scripted connection: answers the hello, then each batch with ``handler``'s ack, in order."""

    def __init__(self, handler: Handler, refuse: dict[str, Any] | None = None,
                 tls: tuple[ssl.SSLContext, ssl.SSLContext] | None = None) -> None:
        """``tls``: the client's and the peer's contexts (the connection is TLS, as a TCP link's)."""
        self.client, self._sock = socket.socketpair()
        self.batches: list[Batch] = []
        self.hello: dict[str, Any] = {}
        self._handler, self._refuse = handler, refuse
        self._tls = tls[1] if tls is not None else None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        if tls is not None:
            self.client = tls[0].wrap_socket(self.client, server_hostname="localhost")

    def _run(self) -> None:
        sock = self._sock
        try:
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_side=True)
            self.hello = recv_frame(sock)
            if self._refuse is not None:
                send_frame(sock, [0, 1, self._refuse])
                return
            send_frame(sock, [0, 0, {"link": 1, "max_frame": MAX_FRAME}])
            while True:
                batch = decode_batch(recv_payload(sock, MAX_FRAME))
                self.batches.append(batch)
                ack = self._handler(batch)
                if ack is None:
                    return
                if isinstance(sock, ssl.SSLSocket):  # (no sendmsg)
                    payload = encode(ack)
                    sock.sendall(len(payload).to_bytes(4, "big") + payload)
                else:
                    send_payload(sock, encode(ack))
        except (EOFError, OSError):
            pass
        finally:
            sock.close()


def ok(batch: Batch) -> Ack:
    last = batch.commands[-1]
    return Ack(batch.id, len(batch.commands), None, b"\x07" * last.size if isinstance(last, Read) else None)


def link(peers: list[Peer], timeout: float | None = 10, **kwargs: Any) -> BatchingTransport:
    """A link whose every (re)connection is the next peer's socket; none left: refused."""
    def connect(_timeout: float | None) -> socket.socket:
        if not peers:
            raise ConnectionRefusedError("no broker here")
        return peers.pop(0).client

    return framed_link(connect, "gpb_x_y", "ses_1", kind="unix", timeout=timeout, **kwargs)


def launch(name: str = "k1") -> Launch:
    return Launch(name, (1, 1, 1), (1, 1, 1), [])


def test_hello_names_token_session_and_link_and_sets_the_chunk_size() -> None:
    peer = Peer(ok)
    t = link([peer])
    assert peer.hello == {"token": "gpb_x_y", "session": "ses_1", "link": 1}
    assert t.max_data == MAX_FRAME - 64 * 1024
    t.close()


def test_a_refused_hello_raises_the_fronts_error() -> None:
    refusal = {"code": "UNAUTHENTICATED", "message": "missing or invalid bearer token", "type": "Unauthenticated"}
    with pytest.raises(Unauthenticated, match="missing or invalid"):
        link([Peer(ok, refuse=refusal)])
    with pytest.raises(Unavailable, match="no unix link to the broker"):
        link([])


def test_commands_keep_program_order_and_numbering_across_batches() -> None:
    peer = Peer(ok)
    t = link([peer], batch_size=8)
    seqs = [t.submit(launch(f"k{i}")) for i in range(100)]
    t.wait()
    assert seqs == list(range(1, 101))
    assert [c.kernel for b in peer.batches for c in b.commands] == [f"k{i}" for i in range(100)]  # type: ignore
    firsts = [b.first for b in peer.batches]
    assert firsts[0] == 1 and all(b.first + len(b.commands) == n for b, n in zip(peer.batches, firsts[1:],
                                                                                     strict=False))
    assert len(peer.batches[0].commands) == 8 and [b.id for b in peer.batches] == list(range(1, len(firsts) + 1))
    t.close()


def test_a_deferred_error_names_its_command_is_raised_once_and_the_rest_of_its_batch_did_not_run() -> None:
    def fail_third(batch: Batch) -> Ack:
        if batch.first <= 3 < batch.first + len(batch.commands):
            done = 3 - batch.first
            return Ack(batch.id, done, CommandError(3, "launch of 'scale'", WireError(
                "INVALID_ARGUMENT", "2 args, 3 given", "InvalidArgument", {"given": 2})))
        return ok(batch)

    t = link([Peer(fail_third)])
    for _ in range(5):
        t.submit(launch())
    with pytest.raises(InvalidArgument, match=r"^command 3 \(launch of 'scale'\) failed: 2 args") as info:
        t.wait()
    assert info.value.details == {"given": 2, "seq": 3, "command": "launch of 'scale'"}
    t.wait()  # reported once
    assert t.call(Synchronize()) is None
    t.close()


def test_a_call_returns_its_result_and_raises_its_own_error_plainly() -> None:
    def handler(batch: Batch) -> Ack:
        last = batch.commands[-1]
        if isinstance(last, Memset):
            seq = batch.first + len(batch.commands) - 1
            return Ack(batch.id, len(batch.commands) - 1, CommandError(seq, "memset", WireError("NOT_FOUND",
                                                                                                 "no buf 'b1'")))
        return ok(batch)

    t = link([Peer(handler)])
    assert t.call(Read(("b1", 0), 0, 5)) == b"\x07" * 5
    t.submit(launch())  # queued, then carried by the call's batch
    with pytest.raises(NotFound, match=r"^no buf 'b1'$") as info:
        t.call(Memset(("b1", 0), 1, -1))
    assert info.value.details["command"] == "memset"
    t.close()


def test_a_call_that_fails_after_an_earlier_deferred_failure_raises_the_earlier_one() -> None:
    """Program order: a queued command failed in an earlier batch (its error deferred), then a call failed (here
    NOT_FOUND: what that command would have made); the call raises the earlier failure, as a synchronous run would
    have, and nothing stays behind for the next sync."""
    def handler(batch: Batch) -> Ack:
        first = batch.commands[0]
        if isinstance(first, Launch):
            return Ack(batch.id, 0, CommandError(batch.first, "launch", WireError("INVALID_ARGUMENT", "bad launch")))
        return Ack(batch.id, 0, CommandError(batch.first, "memset", WireError("NOT_FOUND", "no buf 'b1'")))

    t = link([Peer(handler)])
    for _ in range(16):  # the first batch of a burst: sent at 16
        t.submit(launch())
    with pytest.raises(InvalidArgument, match=r"^command 1 \(launch\) failed: bad launch$"):
        t.call(Memset(("b1", 0), 1, -1))
    t.wait()  # nothing kept
    t.close()


def test_results_of_submitted_reads_arrive_in_order() -> None:
    t = link([Peer(ok)])
    got: list[bytes] = []
    for n in (1, 2, 3, 4, 5, 6):
        t.submit(Read(("b1", 0), 0, n), on_result=got.append)
    t.wait()
    assert got == [b"\x07" * n for n in (1, 2, 3, 4, 5, 6)]
    t.close()


def test_a_write_rides_alone_in_its_batch() -> None:
    peer = Peer(ok)
    t = link([peer])
    t.submit(launch())
    t.submit(Write(("b1", 0), 0, b"x" * 1000))
    t.submit(launch())
    t.wait()
    assert [[type(c).__name__ for c in b.commands] for b in peer.batches] == [["Launch"], ["Write"], ["Launch"]]
    t.close()


def test_back_pressure_bounds_the_unacknowledged_batches() -> None:
    release = threading.Semaphore(0)
    outstanding: list[int] = []

    def slow(batch: Batch) -> Ack:
        outstanding.append(batch.id)
        release.acquire()
        return ok(batch)

    peer = Peer(slow)
    t = link([peer], batch_size=1, window=2)
    t.submit(launch())
    t.submit(launch())  # two in flight: the window is full (the peer holds the first ack)
    third = threading.Thread(target=t.submit, args=(launch(),))
    third.start()
    third.join(0.3)
    assert third.is_alive() and len(peer.batches) == 1  # blocked before sending (the peer read only the first)
    release.release()
    third.join(10)
    assert not third.is_alive()
    for _ in range(3):
        release.release()
    t.wait()
    assert outstanding == [1, 2, 3]
    t.close()


def test_a_link_lost_with_batches_unacknowledged_is_an_error_at_the_next_sync_then_reconnects() -> None:
    peers = [Peer(lambda batch: None)]
    t = link(peers)
    t.submit(launch())
    t.flush()
    peers.append(Peer(ok, refuse={"code": "NOT_FOUND", "message": "no session 'ses_1'"}))  # asked why: gone
    with pytest.raises(NotFound, match="no session"):
        t.wait()
    t.wait()  # reported once
    again = Peer(ok)
    peers.append(again)
    t.call(Synchronize())  # a later command opens a new connection
    assert len(again.batches) == 1
    t.close()
    # A broker that answers the new hello: the session lives, only the connection was lost.
    lost = link([Peer(lambda batch: None), Peer(ok)])
    lost.submit(launch())
    with pytest.raises(Unavailable, match=r"link to the broker was lost.*1 commands unacknowledged"):
        lost.wait()
    lost.close()


def test_an_ack_out_of_step_drops_the_link() -> None:
    t = link([Peer(lambda batch: Ack(batch.id + 5, len(batch.commands)))])
    with pytest.raises(Unavailable, match="out of step"):
        t.call(Synchronize())
    t.close()


def test_an_ack_that_never_comes_is_a_deadline() -> None:
    hold = threading.Event()
    t = link([Peer(lambda batch: (hold.wait(10), ok(batch))[1])], timeout=0.3)
    with pytest.raises(DeadlineExceeded, match=r"no answer from the broker within 0\.3 s"):
        t.call(Synchronize())
    hold.set()
    t.close()


@pytest.mark.parametrize("transport", ["unix", "tls"])
def test_a_links_wait_for_its_last_answer_polls_then_blocks_within_the_calls_bound(
        monkeypatch: pytest.MonkeyPatch, transport: str, tls_contexts: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    """Where the client spins (wire/ring.py), a link's wait for the answer to its last batch polls the socket
    before it blocks: an answer that comes meanwhile ends the poll (nothing left of it), a later one is still
    received once it blocks, and a call's own bound bounds the poll and counts it (a 0.3 s bound with a 0.25 s
    poll: no answer is a deadline after about 0.3 s, not 0.55; a 0.1 s one after about 0.1 s, not 0.25)."""
    from gpubroker.client._transports import _link

    monkeypatch.setattr(_link, "wait_spin_us", lambda: 250_000)
    polls: list[float] = []
    poll = _link._Frames.await_spinning

    def counted(self: Any, seconds: float) -> float:
        polls.append(poll(self, seconds))
        return polls[-1]

    monkeypatch.setattr(_link._Frames, "await_spinning", counted)
    late, hold = threading.Event(), threading.Event()

    def handler(batch: Batch) -> Ack:
        if late.is_set():
            hold.wait(10)  # (answered once the client stopped polling: the test sets it after the deadline)
        return ok(batch)

    t = link([Peer(handler, tls=tls_contexts if transport == "tls" else None)], timeout=10)
    for _ in range(20):
        t.call(Synchronize())
    assert len(polls) == 20 and max(polls) < 0.25  # (every answer came while it polled)
    late.set()
    for bound, poll_took, most in ((0.3, 0.24, 0.5), (0.1, 0.09, 0.2)):
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            t.call(Synchronize(), timeout=bound)
        took = time.monotonic() - t0
        assert polls[-1] >= poll_took and bound <= took < most, (polls[-1], took)
        t.close()  # (a deadline leaves the link out of step: the next call opens another)
        t = link([Peer(handler, tls=tls_contexts if transport == "tls" else None)], timeout=10)
    hold.set()
    t.close()


def test_an_idle_link_closed_by_the_broker_is_reopened_before_the_next_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_core, "_QUIET", 0.0)
    first, second = Peer(ok), Peer(ok)
    t = link([first, second])
    t.call(Synchronize())
    first._sock.shutdown(socket.SHUT_RDWR)  # the broker closes it (idleness): the client's end sees a hang-up
    first.thread.join(5)
    t.call(Synchronize())  # nothing lost, no error: it went on a new connection
    assert len(second.batches) == 1
    t.close()


def test_closed_transport_refuses_commands() -> None:
    t = link([Peer(ok)])
    t.close()
    with pytest.raises(Unavailable, match="closed"):
        t.call(Synchronize())


@pytest.fixture
def no_broker() -> Iterator[Any]:
    import grpc

    from gpubroker.v1 import broker_pb2_grpc as pb_grpc

    channel = grpc.insecure_channel("127.0.0.1:1")
    yield pb_grpc.GpuBrokerStub(channel)
    channel.close()


def test_auto_falls_back_to_grpc_where_no_link_answers_and_link_says_why(no_broker: Any, tmp_path: Any) -> None:
    options: dict[str, Any] = dict(tls=None, token="gpb_x_y", session="ses_1", link_port=0, link_vsock_port=0,
                                   vsock=False, stub=no_broker, metadata=(), timeout=5, max_data=1 << 20)
    target = f"unix:{tmp_path}/gpubroker.sock"  # no "<socket>.fast" there
    chosen = choose_transport("auto", target=target, **options)
    assert isinstance(chosen, BatchingTransport) and isinstance(chosen.carrier, GrpcStream)
    assert choose_transport("grpc", target=target, **options).kind == "grpc"
    with pytest.raises(Unavailable, match=r"no link to the broker's worker: unix: no unix link"):
        choose_transport("link", target=target, **options)
    with pytest.raises(Unavailable, match="the broker offers none"):
        choose_transport("link", target="127.0.0.1:7070", **options)
    if hasattr(socket, "AF_VSOCK"):  # a VM guest's link: tried where told to (no host listens on vsock here)
        with pytest.raises(Unavailable, match=r"unix: no unix link.*; vsock: no vsock link"):
            choose_transport("link", target=target, **{**options, "link_vsock_port": 5000, "vsock": True})
    with pytest.raises(InvalidArgument, match="transport must be one of"):
        choose_transport("carrier-pigeon", target=target, **options)


def test_host_and_port_of_targets() -> None:
    assert split_host_port("127.0.0.1:7070") == ("127.0.0.1", 7070)
    assert split_host_port("[::1]:7070") == ("::1", 7070)
    assert split_host_port("dns:gpu-host.example:443") == ("gpu-host.example", 443)
    with pytest.raises(InvalidArgument):
        split_host_port("gpu-host")


def test_wait_for_reads_acks_up_to_one_command_and_no_further() -> None:
    t = link([Peer(ok)], window=8)
    got: list[int] = []
    seqs = [t.submit(Read(("b1", 0), 0, n), on_result=lambda data: got.append(len(data))) for n in (1, 2, 3)]
    t.submit(launch())  # queued, not sent
    t.wait_for(seqs[1])
    assert got == [1, 2]
    t.wait()
    assert got == [1, 2, 3]
    t.close()


def test_a_batch_over_the_frame_limit_goes_as_several_and_a_command_over_it_is_refused() -> None:
    peer = Peer(ok)
    t = link([peer])
    wide = [ScalarArg("<i4", b"\x01\x00\x00\x00")] * 600  # about 9 KB a launch encoded
    for i in range(256):
        t.submit(Launch(f"k{i}", (1, 1, 1), (1, 1, 1), wide))
    t.wait()
    assert len(peer.batches) > 2 and all(len(encode(b)) <= MAX_FRAME for b in peer.batches)
    assert [c.kernel for b in peer.batches for c in b.commands] == [f"k{i}" for i in range(256)]  # type: ignore
    t.submit(Launch("huge", (1, 1, 1), (1, 1, 1), wide * 200))
    with pytest.raises(InvalidArgument, match=r"command 257 \(Launch\) is \d+ bytes encoded, more than the"):
        t.wait()
    t.call(Synchronize())  # the link is fine
    t.close()


class HeldAcks:
    """A carrier that sees acks as the ring does (``sees_acks``), whose peer answers what it was sent only when
    told to (``answer``): what the core sends while its peer works is then known exactly."""

    kind, max_data, codec, sees_acks = "ring", MAX_FRAME, "", True

    def __init__(self) -> None:
        self.batches: list[Batch] = []
        self._unanswered: list[bytes] = []
        self._answered: list[bytes] = []

    def open(self) -> None:
        pass

    def send(self, payload: bytes) -> None:
        batch = decode_batch(payload)
        self.batches.append(batch)
        self._unanswered.append(encode(ok(batch)))

    def answer(self) -> None:
        self._answered += self._unanswered
        self._unanswered = []

    def receive(self, timeout: float | None, in_flight: int, into: memoryview | None = None) -> bytes:
        self.answer()
        return self._answered.pop(0)

    def arrived(self) -> bytes | None:
        return self._answered.pop(0) if self._answered else None

    def shut(self) -> None:
        pass

    def hung_up(self) -> bool:
        return False

    def why_lost(self, reason: str) -> Unavailable:
        return Unavailable(reason)


def test_where_acks_are_seen_a_command_goes_at_once_to_an_idle_peer_and_those_queued_meanwhile_go_together() -> None:
    """Issue 25's 'queued launches leave the client when the pipe goes idle', on the ring: nothing is held back
    from a worker that has answered everything (its device would idle behind a client still queueing), and while
    it works, commands queue and go as one batch once it has answered: no batch per command."""
    carrier = HeldAcks()
    t = BatchingTransport(carrier, timeout=10)
    t.open()
    t.submit(launch("a"))
    assert carrier.batches == []  # one alone waits for a second (a launch and its sync go as one round trip)
    t.submit(launch("b"))
    assert [[c.kernel for c in b.commands] for b in carrier.batches] == [["a", "b"]]  # type: ignore[attr-defined]
    for name in "cde":
        t.submit(launch(name))
    assert len(carrier.batches) == 1  # the peer is working on "a" and "b": queued
    carrier.answer()
    t.submit(launch("f"))
    assert [[c.kernel for c in b.commands] for b in carrier.batches] == [  # type: ignore[attr-defined]
        ["a", "b"], ["c", "d", "e", "f"]]
    carrier.answer()
    t.submit(launch("g"))
    t.call(Synchronize())  # a call takes what is queued with it
    assert [[type(c).__name__ for c in b.commands] for b in carrier.batches][2:] == [["Launch", "Synchronize"]]
    t.wait()
    # A carrier that cannot see acks cheaply (a socket) sends the first batch of a burst at 16 commands instead.
    peer = Peer(ok)
    sock = link([peer])
    for i in range(15):
        sock.submit(launch(f"k{i}"))
    assert sock._next_id == 1
    sock.submit(launch("k15"))
    assert sock._next_id == 2
    sock.wait()
    assert [len(b.commands) for b in peer.batches] == [16]
    sock.close()


def test_one_batching_core_composes_each_carrier() -> None:
    """Each medium is a carrier the one core owns (issue 22): nothing subclasses the core, and every carrier has
    what the core calls."""
    assert BatchingTransport.__subclasses__() == []
    members = {name for name in vars(Carrier) if not name.startswith("_")}
    assert members == {"kind", "max_data", "codec", "open", "send", "receive", "arrived", "sees_acks", "shut",
                       "hung_up", "why_lost"}
    for carrier in (FramedSocket, RingUpgrade, GrpcStream):
        missing = {name for name in members - set(dir(carrier))
                   if name not in ("kind", "max_data", "codec")}  # (set per instance, or class attributes)
        assert not missing, f"{carrier.__name__} lacks {missing}"
    peer = Peer(ok)
    t = link([peer])
    assert isinstance(t.carrier, FramedSocket) and t.kind == "unix" and t.stripes is None
    t.close()


@pytest.mark.parametrize(("target", "hint"), [
    ("unix:{tmp}/nobody-listens.sock", "no broker is listening there (the socket file does not exist)"),
    ("127.0.0.1:1", "nothing accepts connections at that address"),
    ("{tmp}/nobody-listens.sock", "the target is no host name that resolves: a broker's Unix socket is written"),
    ("10.255.255.1:5000", "a broker on another host is reached over TLS only"),
])
def test_a_connection_mistake_says_what_to_do(tmp_path: Any, target: str, hint: str) -> None:
    """gRPC's own words for a connection that never came to be get the fix in front of them (kept after it)."""
    from gpubroker.client import Unavailable, list_devices

    with pytest.raises(Unavailable) as refused:
        list_devices(target.format(tmp=tmp_path), "gpb_x_y", timeout=10)
    assert refused.value.message.startswith(hint) and "(" in refused.value.message, refused.value.message


def test_a_unix_connection_the_broker_closes_gets_no_tls_hint(tmp_path: Any) -> None:
    """A Unix socket negotiates no TLS: a connection closed as it is made (a broker refusing it over a cap, as its
    front does by closing it) is said to be that, not a certificate the client lacks."""
    import socket
    import threading

    from gpubroker.client import Unavailable, list_devices

    path = str(tmp_path / "closes.sock")
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(16)
    stop = threading.Event()

    def refuse_all() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.close()

    thread = threading.Thread(target=refuse_all, daemon=True)
    thread.start()
    try:
        with pytest.raises(Unavailable) as refused:
            list_devices(f"unix:{path}", "gpb_x_y", timeout=10)
    finally:
        stop.set()
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(5)
    message = refused.value.message
    assert message.startswith("the broker closed the connection: it refuses a connection over its caps"), message
    assert "certificate" not in message


def test_a_unix_links_socket_sends_a_whole_copy_chunk_at_once(tmp_path: Path) -> None:
    """The client's end of a Unix link buffers a copy's 1 MiB chunk (as far as the host's wmem_max lets it), so the
    worker reads a frame in one recv rather than in pieces of the default ~200 KiB, each a wake-up of its loop."""
    path = str(tmp_path / "link.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)
        with unix_connector(path)(1.0) as sock:
            wmem_max = int(Path("/proc/sys/net/core/wmem_max").read_text())
            # (Linux doubles what it is given, for its bookkeeping)
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= 2 * min(2 << 20, wmem_max)


def test_a_reads_bytes_land_only_when_they_are_what_was_asked_for() -> None:
    """``read_into`` takes what ``decode_read_ack`` gives: raw bytes, or ``(codec, bytes)`` where a codec was asked;
    anything else, or another byte count, is the broker's error, and nothing lands."""
    import lz4.block

    from gpubroker.client import GpuBrokerError
    from gpubroker.wire.commands import decode_read_ack

    def result(value: object) -> Any:
        return decode_read_ack(encode(Ack(1, 1, None, value))).result

    data = bytes(range(200)) * 5
    out = bytearray(1000)
    _core.read_into(memoryview(out), 0, 1000)(result(bytearray(data)))
    assert out == data
    for codec_result in (["", bytearray(data)], ["lz4", lz4.block.compress(data, store_size=False)]):
        out = bytearray(1000)
        _core.read_into(memoryview(out), 0, 1000, "lz4")(result(codec_result))
        assert out == data
    out = bytearray(1000)
    for bad, codec, message in ((bytearray(999), "", "with 999"), (["", bytearray(data)], "", "with tuple"),
                                (["lz4", b"\xff" * 64], "lz4", "bad lz4 block"),
                                (["zstd", bytearray(data)], "lz4", "with tuple")):
        with pytest.raises(GpuBrokerError, match=message):
            _core.read_into(memoryview(out), 0, 1000, codec)(result(bad))
    assert out == bytearray(1000)


@pytest.fixture(scope="module")
def tls_contexts(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A client's and a server's TLS context (a CA and its server certificate for localhost)."""
    from gpubroker.broker.certs import init_certs

    ca, server = init_certs(tmp_path_factory.mktemp("ca"))
    client = ssl.create_default_context(cafile=str(ca.cert))
    peer = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    peer.load_cert_chain(str(server.cert), str(server.key))
    return client, peer


@pytest.mark.parametrize("transport", ["unix", "tls"])
def test_a_raw_reads_bytes_are_received_straight_into_where_they_go(
        monkeypatch: pytest.MonkeyPatch, transport: str, tls_contexts: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    """On a socket link a raw Read's answer (its Ack's head, then the bytes) is looked at before it is taken (on
    TLS, which cannot look without taking, its frame's header and head are taken first): the bytes go straight
    from the socket into the caller's memory. Any other answer (a short read, an error) is read as before, and
    lands nothing."""
    from gpubroker.client._transports import _link

    landed: list[int] = []
    name = "_land" if transport == "unix" else "_land_taking"
    land = getattr(_link._Frames, name)

    def counted(self: Any, into: memoryview) -> Any:
        result = land(self, into)
        landed.append(result is not None)
        return result

    monkeypatch.setattr(_link._Frames, name, counted)
    chunk = 256 * 1024
    data = bytes(range(256)) * (4 * chunk // 256)

    def handler(batch: Batch) -> Ack:
        last = batch.commands[-1]
        if isinstance(last, Read):
            if last.buf[0] == "short":
                return Ack(batch.id, len(batch.commands), None, bytearray(last.size - 1))
            if last.buf[0] == "gone":
                seq = batch.first + len(batch.commands) - 1
                return Ack(batch.id, len(batch.commands) - 1, CommandError(seq, "read", WireError("NOT_FOUND", "no")))
            return Ack(batch.id, len(batch.commands), None, bytearray(data[last.offset:last.offset + last.size]))
        return ok(batch)

    t = link([Peer(handler, tls=tls_contexts if transport == "tls" else None)])
    out = bytearray(len(data))
    t.copy_out(("b1", 0), 0, memoryview(out), "", chunk)
    assert out == data and landed == [True] * 4
    out = bytearray(len(data))
    with pytest.raises(GpuBrokerError, match=f"a read of {chunk} bytes with {chunk - 1}"):
        t.copy_out(("short", 0), 0, memoryview(out), "", chunk)
    with pytest.raises(NotFound):
        t.copy_out(("gone", 0), 0, memoryview(out), "", chunk)
    assert out == bytearray(len(data)) and not any(landed[4:])
    t.copy_out(("b1", 0), 0, memoryview(out), "", chunk)  # the link is in step after them
    assert out == data
    t.close()
