"""The command model: one typed command per operation, one encoding, refused when malformed."""

from __future__ import annotations

import ast
from pathlib import Path

import msgspec
import pytest

from gpubroker.wire import commands as p
from gpubroker.wire import torch as t
from gpubroker.wire.errors import InvalidArgument, WireError

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


def _builtin() -> set[type[p.Command]]:
    """The commands of gpubroker itself (a test may define more: tests/broker/test_adding_an_operation.py)."""
    return {c for c in p.commands() if c.__module__ == p.__name__}


def test_every_command_has_a_sample_and_a_unique_tag() -> None:
    assert set(SAMPLES) == _builtin()
    tags = [p.tag_of(c) for c in p.commands()]
    assert len(set(tags)) == len(tags)
    assert _builtin() - {p.LoadModule, p.UnloadModule, p.GetKernel} == p.link_commands() & _builtin()


def test_traits_are_declared_on_the_command_classes() -> None:
    """What each process reads off a command's class (the tables that used to list them in the front and the
    worker): device work waits for the tenant's turn, host work lets the worker use CPU, and results."""
    device_work = {c for c in _builtin() if c.device_work}
    assert device_work == {p.Launch, p.RunLibrary, p.Memset, p.CopyD2D, p.Synchronize, p.Write, p.Read, p.CopyShared,
                           p.RecordEvent, p.WaitEvent, p.SynchronizeEvent}
    assert {c for c in _builtin() if c.host_work} == {p.LoadModule, p.Write, p.Read, p.CopyShared}
    assert {c: c.result for c in _builtin() if c.result is not None} == {
        p.Read: bytes, p.DeviceInfoQuery: p.DeviceReport, p.LoadModule: p.KernelNames}
    assert SAMPLES[p.Memset].describe() == "memset to the end of the view"
    assert SAMPLES[p.Free].describe() == "free of 'b1'"
    assert SAMPLES[p.Launch].describe() == "launch of kernel 'k1'"
    assert SAMPLES[p.Synchronize].describe() == "synchronize"


def test_two_commands_with_one_tag_are_refused() -> None:
    class Twin(p.Command, tag="allocate", frozen=True):
        pass

    try:
        with pytest.raises(TypeError, match="two commands with the tag 'allocate'"):
            p.commands()
    finally:
        del Twin
        import gc

        gc.collect()  # (Command's subclasses are weak references: the twin is gone once collected)
    assert p.tag_of(p.commands()[0]) == "allocate"


# The torch device's commands (gpubroker/wire/torch.py), registered by wire.commands in every process.
TORCH_SAMPLES: dict[type, p.Command] = {
    t.TorchOp: t.TorchOp("aten::add.Tensor", [t.TensorArg("t1"), 2.5, None, [1, 2], "trunc", t.DeviceArg(),
                                               t.DtypeArg("float32"), t.Complex(1.0, -1.0),
                                               t.TensorListArg(["t1", None]), t.MemoryFormatArg("channels_last"),
                                               t.LayoutArg("strided"), True],
                         {"alpha": 2}, ["t2", None], [("float32", (2, 3), (3, 1), 0)], "s1"),
    t.TorchOpSync: t.TorchOpSync("aten::nonzero.default", [t.TensorArg("t1")], {}, ["t3"], ""),
    t.TorchFromBuffer: t.TorchFromBuffer("t1", ("b1", 64), ("int64", (4,), (1,), 0), ""),
    t.TorchToBuffer: t.TorchToBuffer("t1", ("b1", 0), "s1"),
    t.TorchRead: t.TorchRead("t1", ""),
    t.TorchFree: t.TorchFree(["t1", "t2"]),
    t.TorchSeed: t.TorchSeed(-(1 << 63)),
}


def test_the_torch_commands_are_registered_with_their_traits() -> None:
    assert set(TORCH_SAMPLES) == {c for c in p.commands() if c.__module__ == t.__name__}
    assert {c for c in TORCH_SAMPLES if not c.device_work} == {t.TorchFree, t.TorchSeed}
    assert {c for c in TORCH_SAMPLES if c.result is not None} == {t.TorchOpSync, t.TorchRead}
    assert TORCH_SAMPLES[t.TorchOp].describe() == "torch operator aten::add.Tensor"
    assert p.link_commands() >= set(TORCH_SAMPLES)


@pytest.mark.parametrize("command", list(SAMPLES.values()) + list(TORCH_SAMPLES.values()),
                         ids=lambda c: type(c).__name__)
def test_round_trip(command: p.Command) -> None:
    batch = p.Batch(3, 17, [command])
    assert p.decode_batch(p.encode(batch)) == batch


def test_ack_round_trip() -> None:
    error = WireError("INVALID_ARGUMENT", "bad grid", "InvalidArgument", {"fatal": False})
    ack = p.Ack(4, 1, p.CommandError(18, "launch of 'scale'", error), b"\x01\x02")
    assert p.decode_ack(p.encode(ack)) == ack
    assert (ack.error.code, ack.error.message, ack.error.type) == ("INVALID_ARGUMENT", "bad grid", "InvalidArgument")


def test_an_ack_for_the_front_decodes_only_what_the_last_command_returns() -> None:
    read = p.Batch(1, 0, [p.Read(("b1", 0), 0, 4)])
    assert p.decode_ack_for(p.encode(p.Ack(1, 1, None, b"abcd")), read).result == b"abcd"
    with pytest.raises(msgspec.DecodeError, match=r"Expected `bytes \| null`"):
        p.decode_ack_for(p.encode(p.Ack(1, 1, None, [[]] * 1000)), read)
    with pytest.raises(msgspec.DecodeError, match="Expected `null`"):
        p.decode_ack_for(p.encode(p.Ack(1, 1, None, "b_forged")), p.Batch(1, 0, [p.Allocate("b1", 8)]))


def test_a_chunks_bytes_are_decoded_as_a_view_of_the_frame_not_copied() -> None:
    """A Write's bytes in the worker, and a Read's in the client, are views of the frame they came in."""
    frame = bytearray(p.encode(p.Batch(1, 0, [p.Write(("b1", 0), 0, bytes(range(256)) * 4096)])))
    data = p.decode_batch(frame).commands[0].data
    assert type(data) is memoryview and data.obj is frame and data == bytes(range(256)) * 4096
    for result in (bytearray(b"\x07" * 100_000), ["", bytearray(b"\x07" * 100_000)]):
        frame = bytearray(p.encode(p.Ack(2, 1, None, result)))
        got = p.decode_read_ack(frame).result
        view = got if isinstance(got, memoryview) else got[1]
        assert view.obj is frame and view == b"\x07" * 100_000
    assert p.decode_read_ack(p.encode(p.Ack(2, 0, None, None))).result is None


_BIG, _MIB, _SMALL = bytearray(range(256)) * 256, bytearray(1 << 20), bytearray(100)


@pytest.mark.parametrize(("result", "apart"), [
    (None, None), (b"", None), (_SMALL, None), (_BIG, _BIG), (_MIB, _MIB), (["", _BIG], _BIG),
    (["lz4", _BIG], _BIG), (["", _SMALL], None), ({"name": "x"}, None), ([1, 2], None),
], ids=["none", "empty", "small", "large", "1MiB", "raw-pair", "lz4-pair", "small-pair", "dict", "list"])
def test_an_ack_in_two_parts_is_its_encoding(result: object, apart: bytearray | None) -> None:
    """What a worker sends with one sendmsg, its head then a large Read's bytes as they are, is the Ack's one
    encoding: the client decodes it as it decodes any."""
    ack = p.Ack(9, 3, None, result)
    head, tail = p.encode_ack_parts(ack)
    assert head + bytes(tail) == p.encode(ack)
    assert tail is apart if apart is not None else tail == b""


def test_the_head_of_a_raw_reads_ack_is_taken_apart_from_its_bytes_and_nothing_else_is() -> None:
    """A client that takes a Read's bytes straight into the caller's memory reads the Ack's head alone: rewritten
    with an empty result, it decodes as the Ack (its id and count); any other head is not taken so."""
    for data in (_BIG, _MIB, memoryview(bytearray(70_000))):
        head, tail = p.encode_ack_parts(p.Ack(12345, 7, None, data))
        assert len(head) <= p.READ_HEAD_MAX and tail is data
        encoded = p.read_ack_head(head, len(data))
        assert encoded is not None
        assert p.decode_ack(encoded) == p.Ack(12345, 7, None, b"")
        assert p.read_ack_head(head, len(data) - 1) is None  # (another size)
    for result in (["", _BIG], ["lz4", _BIG]):  # a codec's pair: its bytes are not the raw read's
        head, _ = p.encode_ack_parts(p.Ack(1, 1, None, result))
        assert p.read_ack_head(head, len(_BIG)) is None
    error = p.encode(p.Ack(1, 0, p.CommandError(1, "read", WireError("NOT_FOUND", "no"))))
    assert p.read_ack_head(error[:-1] + b"\xc6" + len(_BIG).to_bytes(4, "big"), len(_BIG)) is None
    assert p.read_ack_head(b"\xc6" + len(_BIG).to_bytes(4, "big"), len(_BIG)) is None  # (no Ack before it)


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
    msgspec.msgpack.encode([1, 1, [["torch_op", "aten::add.Tensor", [{"k": "t", "h": ""}], {}, [], [], ""]]]),
    msgspec.msgpack.encode([1, 1, [["torch_op", "aten::add.Tensor", [{"k": "zz"}], {}, [], [], ""]]]),
    msgspec.msgpack.encode([1, 1, [["torch_op", "a" * 129, [], {}, [], [], ""]]]),  # name too long
    msgspec.msgpack.encode([1, 1, [["torch_op", "aten::x.y", [0] * 65, {}, [], [], ""]]]),  # too many args
    msgspec.msgpack.encode([1, 1, [["torch_from_buffer", "t", ["b", 0], ["float32", [-1], [1], 0], ""]]]),
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



def test_the_wire_has_one_encoder_and_owns_every_decoder() -> None:
    """Every message between processes is a type of gpubroker/wire, encoded by the one encoder (wire/encoding.py
    ``encode``, which wire/commands.py names too) and decoded by the wire's own decoders: no module elsewhere
    builds a msgspec codec or encodes with one (the front checks a worker's replies with the wire's decoders of
    each request's result type)."""
    codecs = {str(path.relative_to(ROOT)): calls for path in sorted((ROOT / "src" / "gpubroker").rglob("*.py"))
              if (calls := _msgspec_codec_calls(path))}
    assert all(path.startswith("src/gpubroker/wire/") for path in codecs), codecs
    encoders = {path: encoding for path, calls in codecs.items()
                if (encoding := [call for call in calls if call != "msgspec.msgpack.Decoder"])}
    assert encoders == {"src/gpubroker/wire/encoding.py": ["msgspec.msgpack.Encoder"]}, encoders


def test_the_fronts_outline_holds_every_field_it_checks() -> None:
    """The front decodes only an outline of a client's batch (``outline_batch``): each command of its class, every
    field but its ``front_skips`` as decoded in full; the skipped ones are stepped over (the worker decodes them)."""
    samples = [*SAMPLES.values(),
               t.TorchOp("aten::add.Tensor", [t.TensorArg("t1"), 2], {"alpha": 1.5}, ["t2"],
                         [("float32", (4,), (1,), 0)], "s1"),
               t.TorchOpSync("aten::nonzero.default", [t.TensorArg("t1")], {}, ["t2"], ""),
               t.TorchFree(["t1", "t2"])]
    batch = p.Batch(7, 40, samples)
    outline = p.outline_batch(p.encode(batch))
    assert (outline.id, outline.first, len(outline.commands)) == (7, 40, len(samples))
    for full, seen in zip(samples, outline.commands, strict=True):
        assert isinstance(seen, type(full)) and p.tag_of(seen) == p.tag_of(full)
        for field in msgspec.structs.fields(full):
            if field.name in type(full).front_skips:
                assert isinstance(getattr(seen, field.name), msgspec.Raw)
            else:
                assert getattr(seen, field.name) == getattr(full, field.name), (full, field.name)
    for cls in p.commands():
        assert set(cls.front_skips) <= {f.name for f in msgspec.structs.fields(cls)}, cls
    assert not any(c.outline for c in p.commands())  # (the outlines are no commands of their own)


def test_the_front_refuses_a_batch_of_too_many_commands() -> None:
    p.outline_batch(p.encode(p.Batch(1, 0, [p.Free("b1")] * p.MAX_FRONT_COMMANDS)))
    with pytest.raises(InvalidArgument, match=f"at most {p.MAX_FRONT_COMMANDS} commands"):
        p.outline_batch(p.encode(p.Batch(1, 0, [p.Free("b1")] * (p.MAX_FRONT_COMMANDS + 1))))
    # (what it steps over is only scanned: malformed there, the worker refuses it)
    launch = msgspec.msgpack.encode([1, 0, [["launch", "k1", [1], [1], [{"bad": 1}], 0, ""]]])
    assert isinstance(p.outline_batch(launch).commands[0], p.Launch)
    with pytest.raises(msgspec.DecodeError):
        p.decode_batch(launch)
