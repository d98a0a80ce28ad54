"""lz4 on copies' bytes, negotiated per link: copies over the TCP link (TLS) byte-identical with it on and off, a
compressed Write that lies about its size (or is a bomb) refused without harm, and a codec the worker does not know
not negotiated."""

from __future__ import annotations

import lz4.block
import numpy as np
import pytest

from gpubroker.broker.worker._executor import _RAW_READS
from gpubroker.client import InvalidArgument, OutOfRange, RemoteGpu
from gpubroker.client._transports import BatchingTransport, FramedSocket, framed_link
from gpubroker.wire.commands import Read, Write

from ..conftest import OpenGpu

CHUNK = 256 * 1024  # several chunks per copy, and a short last one


def _datasets(size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(13)
    return {
        "zeros": np.zeros(size, np.uint8),
        "arange": np.arange(size // 4 + 1, dtype=np.uint32).view(np.uint8)[:size],
        "random": rng.integers(0, 256, size, dtype=np.uint8),
        # compressible chunks and random ones in one copy: each chunk is sent as what pays for it
        "mixed": np.concatenate([np.zeros(CHUNK, np.uint8), rng.integers(0, 256, size - CHUNK, dtype=np.uint8)]),
    }


def _round_trip(gpu: RemoteGpu, data: np.ndarray, offset: int) -> np.ndarray:
    buf = gpu.allocate_memory(data.nbytes + offset + 100)
    try:
        gpu.memset(buf, 0xAB)
        gpu.copy_h2d(data, buf, offset=offset)
        out = np.empty(data.nbytes + offset + 100, np.uint8)
        gpu.copy_d2h(buf, out)
        assert (out[:offset] == 0xAB).all() and (out[offset + data.nbytes:] == 0xAB).all()
        back = np.empty(data.nbytes, np.uint8)
        gpu.copy_d2h(buf, back, offset=offset)  # (a Read from an offset, chunked the same way)
        np.testing.assert_array_equal(back, out[offset:offset + data.nbytes])
        return out[offset:offset + data.nbytes]
    finally:
        gpu.free_memory(buf)


@pytest.mark.parametrize("compress", [None, "lz4"])
def test_copies_over_tcp_are_byte_identical_with_and_without_lz4(open_gpu: OpenGpu, compress: str | None) -> None:
    with open_gpu("alice", "tcp-tls", compress=compress, chunk_bytes=CHUNK) as gpu:
        link = gpu.transport
        assert isinstance(link, BatchingTransport) and link.codec == (compress or "")
        size = 3 * CHUNK + 4321
        for name, data in _datasets(size).items():
            for offset in (0, 7, CHUNK - 1):
                np.testing.assert_array_equal(_round_trip(gpu, data, offset), data, err_msg=f"{name} at {offset}")
        for edge in (1, CHUNK - 1, CHUNK, CHUNK + 1):  # chunk edges
            data = np.arange(edge, dtype=np.uint8)
            np.testing.assert_array_equal(_round_trip(gpu, data, 3), data)
        # Random chunks (then sent raw untried for a while), then compressible ones again.
        rng = np.random.default_rng(5)
        data = np.concatenate([rng.integers(0, 256, 3 * CHUNK, dtype=np.uint8), np.zeros(20 * CHUNK, np.uint8),
                               rng.integers(0, 256, CHUNK, dtype=np.uint8)])
        np.testing.assert_array_equal(_round_trip(gpu, data, 1), data)
        zeros = memoryview(np.zeros(CHUNK, np.uint8)).cast("B")
        link._raw_writes = 0  # (the last chunk was random: the next ones would go raw untried)
        assert link.write_command(("b0", 0), 0, zeros, "").codec == (compress or "")  # (it did compress)
        buf = gpu.allocate_memory(CHUNK)
        gpu.memset(buf, 0)
        # (the session's last Read was random: the worker sends up to _RAW_READS more raw untried)
        for _ in range(_RAW_READS + 1):
            result = link.call(Read((buf.handle, buf.offset), 0, CHUNK, codec="lz4"))
        if compress:  # the worker compressed the Read's result
            assert result[0] == "lz4" and lz4.block.decompress(result[1], uncompressed_size=CHUNK) == bytes(CHUNK)
        else:  # not negotiated on this link: the bytes as they are
            assert result == bytes(CHUNK)


def test_auto_takes_lz4_on_tcp_only(open_gpu: OpenGpu) -> None:
    with open_gpu("alice", "tcp-tls") as gpu:  # (compress="auto", the default)
        assert isinstance(gpu.transport, BatchingTransport) and gpu.transport.codec == "lz4"
    with open_gpu("alice", "link") as gpu:  # the same host: bytes move faster than lz4 packs them
        assert isinstance(gpu.transport, BatchingTransport) and gpu.transport.codec == ""


def test_compressed_writes_that_lie_are_refused_and_the_link_lives_on(open_gpu: OpenGpu) -> None:
    with open_gpu("alice", "tcp-tls", compress="lz4") as gpu:
        link = gpu.transport
        size = 4 << 20  # larger than a frame: a Write may say it holds more than a link's frame could
        buf = gpu.allocate_memory(size)
        ref = (buf.handle, buf.offset)
        big = lz4.block.compress(bytes(64 * 1024), store_size=False)  # 64 KiB of zeros in a few hundred bytes
        hostile = {
            "claims fewer bytes than it holds": Write(ref, 0, big, codec="lz4", size=100),
            "claims more bytes than it holds": Write(ref, 0, lz4.block.compress(bytes(1000), store_size=False),
                                                     codec="lz4", size=2000),
            "a bomb past the max frame": Write(ref, 0, lz4.block.compress(bytes(size), store_size=False),
                                               codec="lz4", size=size),
            "not lz4": Write(ref, 0, b"\xff" * 64, codec="lz4", size=1000),
            "an unknown codec": Write(ref, 0, b"abc", codec="zstd", size=3),
        }
        for command in hostile.values():
            with pytest.raises(InvalidArgument, match=r"lz4|codec"):
                link.call(command)
        with pytest.raises(OutOfRange):  # a block that says more than the buffer holds: as a raw write would be
            link.call(Write(ref, 0, b"\x00", codec="lz4", size=1 << 40))
        data = np.arange(size, dtype=np.uint8)  # the link and the worker live on
        gpu.copy_h2d(data, buf)
        out = np.empty(size, np.uint8)
        gpu.copy_d2h(buf, out)
        np.testing.assert_array_equal(out, data)


def test_an_unknown_codec_is_not_negotiated(open_gpu: OpenGpu) -> None:
    with open_gpu("alice", "tcp-tls", compress=None) as gpu:
        link = gpu.transport
        assert isinstance(link, BatchingTransport) and isinstance(link.carrier, FramedSocket)
        other = framed_link(link.carrier._connect, gpu._token, gpu.session, kind="tcp", timeout=30, compress="zstd")
        try:
            assert other.codec == ""  # the worker answered the hello naming no codec
            buf = gpu.allocate_memory(4096)
            gpu.memset(buf, 5)
            # A Read asking for lz4 on a link that did not negotiate it gets the bytes as they are.
            assert other.call(Read((buf.handle, buf.offset), 0, 4096, codec="lz4")) == b"\x05" * 4096
        finally:
            other.close()
    with pytest.raises(InvalidArgument, match="compress"):
        open_gpu("alice", "tcp-tls", compress="zstd")


def test_grpc_reads_are_never_compressed(open_gpu: OpenGpu) -> None:
    """The front checks a Read's result is exactly its bytes: a client asking gRPC for lz4 gets them raw (and the
    worker is not taken for a liar)."""
    with open_gpu("alice", "grpc") as gpu:
        buf = gpu.allocate_memory(4096)
        gpu.memset(buf, 6)
        assert gpu.transport.call(Read((buf.handle, buf.offset), 0, 4096, codec="lz4")) == b"\x06" * 4096
        gpu.synchronize()
