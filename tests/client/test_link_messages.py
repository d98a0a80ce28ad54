"""The link's typed messages (src/gpubroker/wire/link.py): the same bytes as the untyped maps they replaced (a
client of another language sees no change), and any bytes that are not the message expected raise Malformed with a
short reason, never another exception."""

from __future__ import annotations

import random

import msgpack
import msgspec
import pytest

from gpubroker.wire.errors import NotFound, ResourceExhausted
from gpubroker.wire.link import (
    Hello,
    LinkAccepted,
    Malformed,
    RegisterSegment,
    ReleaseSegment,
    RingGranted,
    RingRequest,
    SegmentRegistered,
    SegmentReleased,
    SegmentsAccepted,
    accepted,
    decode_hello,
    decode_segment_request,
    encode,
    open_answer,
    refusal,
)


def test_the_messages_are_the_maps_they_replaced_byte_for_byte() -> None:
    assert encode(Hello(token="gpb_x_y", session="ses_1", link=1)) == msgpack.packb(
        {"token": "gpb_x_y", "session": "ses_1", "link": 1})
    assert encode(Hello(token="t", session="s", link=1, compress=("lz4",))) == msgpack.packb(
        {"token": "t", "session": "s", "link": 1, "compress": ["lz4"]})
    assert accepted(LinkAccepted(link=1, max_frame=1 << 20)) == msgpack.packb([0, 0, {"link": 1, "max_frame": 1 << 20}])
    assert accepted(LinkAccepted(link=1, max_frame=9, compress="lz4")) == msgpack.packb(
        [0, 0, {"link": 1, "max_frame": 9, "compress": "lz4"}])
    assert encode(Hello(token="t", session="s", link=1, ring=RingRequest(window=4, spin_us=3))) == msgpack.packb(
        {"token": "t", "session": "s", "link": 1, "ring": {"window": 4, "spin_us": 3}})
    assert accepted(RingGranted(ring=1, commands=8, acks=9)) == msgpack.packb(
        [0, 0, {"ring": 1, "commands": 8, "acks": 9}])
    assert accepted(RingGranted(ring=0, reason="full")) == msgpack.packb([0, 0, {"ring": 0, "reason": "full"}])
    assert accepted(LinkAccepted(link=1, max_frame=9, ring=1)) == msgpack.packb(
        [0, 0, {"link": 1, "max_frame": 9, "ring": 1}])
    error = NotFound("no session 'x'")
    assert refusal(error) == msgpack.packb([0, 1, msgspec.structs.asdict(error.as_wire())], use_bin_type=True)


def test_a_newer_clients_extra_fields_are_ignored() -> None:
    hello = decode_hello(msgpack.packb({"token": "t", "session": "s", "link": 1, "hello": 1, "x": [1, {"k": None}]}))
    assert hello == Hello(token="t", session="s", link=1)
    assert decode_hello(msgpack.packb({"token": None, "segments": 1})).segments == 1
    assert decode_hello(msgpack.packb({"link": 1, "ring": {"window": 2, "more": 1}})).ring == RingRequest(window=2)
    for ring in ({"window": 0}, {"window": 9}, {"window": 4, "spin_us": -1}, {"window": 4, "spin_us": 201}, 4, []):
        with pytest.raises(Malformed):
            decode_hello(msgpack.packb({"link": 1, "ring": ring}))


def test_answers_open_to_their_result_or_raise_their_error() -> None:
    assert open_answer(accepted(SegmentsAccepted()), SegmentsAccepted).segments == 1
    assert open_answer(accepted(SegmentRegistered("g1", 4096)), SegmentRegistered) == SegmentRegistered("g1", 4096)
    assert open_answer(accepted(SegmentReleased()), SegmentReleased).released
    with pytest.raises(ResourceExhausted) as info:
        open_answer(refusal(ResourceExhausted("over", limit=3)), SegmentRegistered)
    assert info.value.message == "over" and info.value.details == {"limit": 3}
    for bad in ([0, 0, {"ring": 1}], [0, 2, {}], [0, 1, {"code": 5}], [0, 1], {"error": "x"}):
        with pytest.raises(Malformed):
            open_answer(msgpack.packb(bad), LinkAccepted)


SEGMENT_REQUESTS = [["register", None, 4096], ["register", "", 4096], ["register", "g" * 65, 1],
                    ["register", "g1", 0], ["register", "g1", -1], ["register", "g1", True], ["register", "g1"],
                    ["release"], ["release", 7], ["nope", "g1"], {"register": "g1"}, "register", None]


@pytest.mark.parametrize("request_", SEGMENT_REQUESTS, ids=[repr(r)[:30] for r in SEGMENT_REQUESTS])
def test_a_malformed_segment_request_says_why(request_: object) -> None:
    with pytest.raises(Malformed) as info:
        decode_segment_request(msgpack.packb(request_))
    assert 0 < len(str(info.value)) <= 200


def test_segment_requests_are_tagged_arrays() -> None:
    assert decode_segment_request(encode(RegisterSegment("g1", 4096))) == RegisterSegment("g1", 4096)
    assert decode_segment_request(msgpack.packb(["release", "g1"])) == ReleaseSegment("g1")


def test_any_bytes_decode_to_a_message_or_malformed() -> None:
    rng = random.Random(22)
    base = msgpack.packb({"token": "gpb_" + "x" * 40, "session": "ses_0123", "link": 1, "compress": ["lz4"]})
    samples = [b"\x91" * 100_000 + b"\xc0", b"\x82\xa4link\x01\xa1x" + b"\x91" * 100_000 + b"\xc0",
               b"\x81\xa5token\xa2\xff\xfe", b"\xdd\xff\xff\xff\xff", b""]
    for _ in range(2000):
        data = bytearray(base)
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        samples.append(bytes(data[:rng.randint(1, len(data))]))
    for data in samples:
        for decode in (decode_hello, decode_segment_request):
            try:
                decode(data)
            except Malformed:
                pass
