"""The ring's awake words (gpubroker/wire/ring.py): a producer rings only a consumer that may block, and a consumer
that says it may block looks at the ring once more first, so no record is left unseen; and its byte rings' records
across the ring's end."""

from __future__ import annotations

import mmap
import random
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


def test_records_of_any_size_come_out_whole_and_in_order_across_the_rings_end() -> None:
    """A record is its length then its bytes, written at once where it fits before the ring's end and in two
    pieces where it wraps: either way the consumer gets every record whole, in order, and no more than fits."""
    cap = 4096
    mm = mmap.mmap(-1, RING_DATA + cap)
    words = memoryview(mm).cast("Q")
    producer = ByteRing(mm, words, RING_DATA, cap, 0, 8, cap)
    consumer = ByteRing(mm, words, RING_DATA, cap, 0, 8, cap)
    rng = random.Random(1)
    sent: list[bytes] = []
    for _ in range(5000):
        if rng.random() < 0.55:
            record = rng.randbytes(rng.randrange(0, 700))
            if producer.put(record):
                sent.append(record)
            else:
                assert sum(4 + len(r) for r in sent) + 4 + len(record) > cap
        else:
            got = consumer.get()
            assert got == (sent.pop(0) if sent else None)
    while sent:
        assert consumer.get() == sent.pop(0)
    words.release()
    mm.close()
