"""The command model: one typed command per operation, one encoding, refused when malformed."""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec
import pytest

from gpubroker.wire import commands as p

ROOT = Path(__file__).resolve().parents[2]
SAMPLES: dict[type, p.Command] = {
    p.Allocate: p.Allocate("b1", 4096),
    p.Free: p.Free("b1"),
    p.Memset: p.Memset(("b1", 16), 7, -1, 4, "s1"),
    p.CopyD2D: p.CopyD2D(("b1", 0), ("b2", 8), 64, 1, 2, ""),
    p.Launch: p.Launch("k1", (4, 1), (64,), [p.BufferArg("b1", 8), p.ScalarArg("<f4", b"\0\0\x80?")], 128, "s1"),
    p.RunLibrary: p.RunLibrary("linalg.svd", [(("b1", 0), "float32", (4, 3, 5))],
                               [(("b2", 0), "float32", (4, 3, 3)), (("b2", 192), "float32", (4, 3)),
                                (("b3", 64), "float32", (4, 5, 5))],
                               {"full_matrices": True, "rtol": 1.5, "n": 3, "norm": "ortho", "s": [1, -1], "x": None},
                               "s1"),
    p.CreateStream: p.CreateStream("s1"),
    p.DestroyStream: p.DestroyStream("s1"),
    p.Synchronize: p.Synchronize("s1"),
    p.CreateEvent: p.CreateEvent("e1"),
    p.DestroyEvent: p.DestroyEvent("e1"),
    p.RecordEvent: p.RecordEvent("e1", "s1"),
    p.WaitEvent: p.WaitEvent("e1", ""),
    p.SynchronizeEvent: p.SynchronizeEvent("e1"),
    p.Write: p.Write(("b1", 0), 4, b"abcd", ""),
    p.Read: p.Read(("b1", 0), 4, 16, ""),
    p.CopyShared: p.CopyShared("g1", 0, ("b1", 0), 0, 4096, True, ""),
    p.DeviceInfoQuery: p.DeviceInfoQuery(),
    p.LoadModule: p.LoadModule("m1", "opencl_c", b"__kernel void f() {}", ["-cl-fast-relaxed-math"]),
    p.UnloadModule: p.UnloadModule("m1"),
    p.GetKernel: p.GetKernel("k1", "m1", "f"),
}


def test_every_command_has_a_sample_and_a_unique_tag() -> None:
    assert set(SAMPLES) == set(p.COMMANDS)
    tags = [c.__struct_config__.tag for c in p.COMMANDS]
    assert len(set(tags)) == len(tags)
    assert set(p.COMMANDS) - {p.LoadModule, p.UnloadModule, p.GetKernel} == p.LINK_COMMANDS


@pytest.mark.parametrize("command", list(SAMPLES.values()), ids=lambda c: type(c).__name__)
def test_round_trip(command: p.Command) -> None:
    batch = p.Batch(3, 17, [command])
    assert p.decode_batch(p.encode(batch)) == batch


def test_ack_round_trip() -> None:
    ack = p.Ack(4, 1, p.CommandError(18, "launch of 'scale'", "INVALID_ARGUMENT", "bad grid", "InvalidArgument",
                                     {"fatal": False}), b"\x01\x02")
    assert p.decode_ack(p.encode(ack)) == ack


@pytest.mark.parametrize("raw", [
    b"", b"\xc1", msgspec.msgpack.encode([1, 1, [["explode", 1]]]),  # no such command
    msgspec.msgpack.encode([1, 1, [["allocate", "b1", 0]]]),  # size must be > 0
    msgspec.msgpack.encode([1, 1, [["run_library", "sort", [[["b1", 0], "float32", [-1]]], [], {}, ""]]]),  # extent
    msgspec.msgpack.encode([1, 1, [["run_library", "sort", [], [], {"axis": {"a": 1}}, ""]]]),  # param of no kind
    msgspec.msgpack.encode([1, 1, [["run_library", "sort", [], [], {"axis": [1] * 33}, ""]]]),  # list too long
    msgspec.msgpack.encode([1, 1, [["run_library", "x" * 33, [], [], {}, ""]]]),  # op name too long
    msgspec.msgpack.encode([1, 1, [["allocate", "b" * 65, 8]]]),  # handle too long
    msgspec.msgpack.encode([1, 1, [["memset", ["b1", 0], 256, -1, 0, ""]]]),  # not a byte value
    msgspec.msgpack.encode([1, 1, [["launch", "k", [1, 1, 1, 1], [1], [], 0, ""]]]),  # four grid extents
    msgspec.msgpack.encode([1, 1, [["launch", "k", [1], [1], [["s", "<f8", b"\0" * 9]], 0, ""]]]),
    msgspec.msgpack.encode([1, 1, [["read", ["b1", -1], 0, 4, ""]]]),  # negative view offset
    msgspec.msgpack.encode({"id": 1}),
])
def test_malformed_batches_are_refused(raw: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        p.decode_batch(raw)


def test_handles_are_random_and_short() -> None:
    handles = {p.new_handle("buf") for _ in range(1000)}
    assert len(handles) == 1000
    assert all(h.startswith("b") and len(h) <= p.MAX_HANDLE for h in handles)


def _msgspec_codec_calls(path: Path) -> list[str]:
    """Calls that make a msgspec msgpack codec or encode with one, in a module (by name, as written)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in ("Encoder", "Decoder", "encode", "decode"):
            base = ast.unparse(node.value)
            if base in ("msgspec.msgpack", "msgpack"):
                found.append(f"{base}.{node.attr}")
    return found


# The front's check of what a worker replies (issue 21: a reply is decoded against the schema of the request it
# answers, never as arbitrary msgpack): the frame's envelope, and the results' schemas. Decoders only: the
# replies' bytes are the worker's, encoded by the one command model's codec.
REPLY_SCHEMAS = {"src/gpubroker/wire/worker.py", "src/gpubroker/broker/front/workers/_replies.py"}
# The link's own messages (hello, ring upgrade, segment requests): their schemas' decoders, encoded by the same one
# encoder as the commands.
LINK_SCHEMAS = {"src/gpubroker/wire/link.py"}


def test_commands_have_one_encoder() -> None:
    """Only src/gpubroker/wire/commands.py encodes or decodes commands: no module builds a codec of its own (besides
    the front's schema decoders for worker replies, which encode nothing)."""
    codecs = {str(path.relative_to(ROOT)): calls for path in sorted((ROOT / "src" / "gpubroker").rglob("*.py"))
              if (calls := _msgspec_codec_calls(path))}
    assert set(codecs) == {"src/gpubroker/wire/commands.py", *REPLY_SCHEMAS, *LINK_SCHEMAS}, codecs
    for path in REPLY_SCHEMAS | LINK_SCHEMAS:
        assert set(codecs[path]) == {"msgspec.msgpack.Decoder"}, (path, codecs[path])
