"""The ring's awake words (gpubroker/wire/ring.py): a producer rings only a consumer that may block, and a consumer
that says it may block looks at the ring once more first, so no record is left unseen."""

from __future__ import annotations

import mmap
import socket

from gpubroker.wire.ring import (
    CMD_HEAD,
    CMD_TAIL,
    RING_DATA,
    WORKER_AWAKE,
    ByteRing,
    drain_bell,
    rest,
    ring_unless_awake,
)


def _pending(sock: socket.socket) -> bytes:
    try:
        return sock.recv(64, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return b""


def test_a_record_rings_only_a_consumer_that_may_block_and_one_going_to_block_finds_what_came() -> None:
    mm = mmap.mmap(-1, RING_DATA + 4096)
    words = memoryview(mm).cast("Q")
    producer = ByteRing(mm, words, RING_DATA, 4096, CMD_HEAD * 8, CMD_TAIL * 8, 1024)
    consumer = ByteRing(mm, words, RING_DATA, 4096, CMD_HEAD * 8, CMD_TAIL * 8, 1024)
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        assert words[WORKER_AWAKE] == 0  # a consumer that never said otherwise (an older one) is rung
        assert producer.put(b"one")
        ring_unless_awake(words, WORKER_AWAKE, ours)
        assert _pending(theirs) == b"\x01"
        words[WORKER_AWAKE] = 1  # the consumer polls the ring: no doorbell
        assert producer.put(b"two")
        ring_unless_awake(words, WORKER_AWAKE, ours)
        assert _pending(theirs) == b""
        # Going to block, the consumer says so and looks once more: both records are there (no bell needed).
        assert rest(words, WORKER_AWAKE, consumer) and words[WORKER_AWAKE] == 0
        assert consumer.get() == b"one" and consumer.get() == b"two"
        assert not rest(words, WORKER_AWAKE, consumer)  # nothing more: it may block, and is rung from now on
        assert producer.put(b"three")
        ring_unless_awake(words, WORKER_AWAKE, ours)
        assert drain_bell(theirs) and consumer.get() == b"three"
    finally:
        words.release()
        mm.close()
        ours.close()
        theirs.close()
