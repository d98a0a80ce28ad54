"""The fuzzer's steps for modules, kernels, launches, streams, command batches, the Admin service and raw bytes."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import grpc
from hypothesis import strategies as st

from gpubroker.v1 import admin_pb2 as apb
from gpubroker.v1 import broker_pb2 as pb
from gpubroker_bench.fuzz._fields import Fields
from gpubroker_bench.fuzz._model import Sess
from gpubroker_bench.fuzz._values import FUZZ_KERNELS, block_dims, dtypes, fuzz_source, grid_dims, module_images

__all__ = ["CodeStepsMixin"]

Draw = Callable[..., Any]
_OPTIONS = [[], [], ["-DFUZZ=1"], ["-cl-fast-relaxed-math"], ["--no-such-option"], ["-I", "/nonexistent"], ["-D"],
            ["a\x00b"], [""], ["-Werror"]]
# Messages of random bytes go to these; OpenSession is left out (a random request may open a real session).
_RAW_UNARY = ["CloseSession", "Heartbeat", "GetDeviceInfo", "Allocate", "Free", "Memset", "CopyDeviceToDevice",
              "LoadModule", "GetKernel", "LaunchKernel", "CreateStream", "DestroyStream", "Synchronize", "CopyShared",
              "ListDevices"]
# The fuzz kernels' parameters (_values.py), as the arguments a sane launch passes.
_SIGNATURES = {"fz_noop": (), "fz_args": ("buffer", "<i4", "<f4", "<i8"), "fz_local": ("buffer",)}
_RAW_STREAMING = {"CopyDeviceToHost": "unary_stream", "CopyHostToDevice": "stream_unary", "Commands": "stream_stream"}


class CodeStepsMixin:
    def built_step(self, draw: Draw, method: str, build: Callable[..., tuple[Any, bool, Callable[[], None]]],
                   why: str) -> None:
        """One call of a request that ``build`` draws (the same builders make the batches' commands): refused
        exactly when ``build`` said it is bad, and on OK its effect applied to the model."""
        token, session, sess = self.caller(draw)
        request, bad, effect = build(draw, session, sess)
        _, code, _ = self.call(method, request, token)
        self.refused(method, code, why, bad)
        self.lost(code, sess)
        if code == "OK":
            effect()

    # -- modules and kernels ----------------------------------------------------------------------
    def step_load_module(self, draw: Draw) -> None:
        token, session, sess = self.caller(draw)
        f = Fields(draw, ["format", "image", "options"])
        native = pb.MODULE_FORMAT_CUDA_C if self.backend == "cuda" else pb.MODULE_FORMAT_OPENCL_C
        source = fuzz_source(self.backend)
        fmt = f("format", st.just(native), st.sampled_from([native, 0, 1, 2, 3, 4, 5, 99]))
        image = f("image", st.just(source.encode()), module_images(source, self.limits["max_module_bytes"]))
        options = f("options", st.just([]), st.sampled_from(_OPTIONS))
        resp, code, _ = self.call("LoadModule", pb.LoadModuleRequest(session=session, format=fmt, image=image,
                                                                     options=options), token)
        self.refused("LoadModule", code, "invalid caller, format or size", sess is None, fmt not in range(1, 6),
                     len(image) > self.limits["max_module_bytes"])
        self.lost(code, sess)
        if code == "OK" and sess is not None:
            sess.modules[resp.handle] = list(resp.kernel_names)

    def step_get_kernel(self, draw: Draw) -> None:
        token, session, sess = self.caller(draw)
        f = Fields(draw, ["module", "name"])
        handle, names = self.handle(draw, sess, "module", f.sane("module"))
        name = f("name", st.sampled_from(names or list(FUZZ_KERNELS)),
                 st.sampled_from([*(names or []), *FUZZ_KERNELS, "", "nope", "fz_noop\x00", "fz_" * 100]))
        resp, code, _ = self.call("GetKernel", pb.GetKernelRequest(session=session, module=handle, name=name), token)
        self.refused("GetKernel", code, f"no kernel {name!r} in a live module of the session", sess is None,
                     names is None, name not in (names or []))
        self.lost(code, sess)
        if code == "OK" and sess is not None:
            sess.kernels[resp.handle] = name

    def _sane_args(self, draw: Draw, sess: Sess | None, f: Fields, name: str | None) -> list[pb.KernelArg]:
        """Arguments that fit the fuzz kernel's parameters."""
        args = []
        for kind in _SIGNATURES.get(name or "", ()):
            if kind == "buffer":
                ref, _, _ = self.ref(draw, sess, f, "args")
                args.append(pb.KernelArg(buffer=ref))
            else:
                args.append(pb.KernelArg(scalar=pb.ScalarArg(dtype=kind, value=draw(st.binary(
                    min_size=int(kind[2]), max_size=int(kind[2]))))))
        return args

    def _wild_args(self, draw: Draw, sess: Sess | None, f: Fields) -> tuple[list[pb.KernelArg], bool]:
        """Any arguments: buffers, scalars of any dtype and width, empty ones; and whether the model knows any bad."""
        args: list[pb.KernelArg] = []
        bad = False
        for _ in range(draw(st.integers(0, 5))):
            kind = draw(st.sampled_from(["buffer", "buffer", "scalar", "scalar", "empty"]))
            if kind == "buffer":
                ref, buf, voff = self.ref(draw, sess, f, "args")
                args.append(pb.KernelArg(buffer=ref))
                bad = bad or buf is None or voff > buf.size
            elif kind == "scalar":
                value = draw(st.one_of(st.binary(max_size=9), st.sampled_from([b"\x01\0\0\0", b"\xff" * 8])))
                args.append(pb.KernelArg(scalar=pb.ScalarArg(dtype=draw(dtypes()), value=value)))
            else:
                args.append(pb.KernelArg())
                bad = True
        return args, bad

    def launch_request(self, draw: Draw, session: str, sess: Sess | None
                       ) -> tuple[pb.LaunchKernelRequest, bool, Callable[[], None]]:
        """A launch (the fuzz kernels write nothing, so a successful one changes no byte)."""
        f = Fields(draw, ["kernel", "grid", "block", "stream", "args", "args view", "shared_mem"])
        handle, name = self.handle(draw, sess, "kernel", f.sane("kernel"))
        info = self.devices[0]
        max_grid, max_block = max(info.max_grid_dims), max(info.max_block_dims)
        extents = st.lists(st.integers(1, 4), min_size=1, max_size=3)
        grid = f("grid", extents, grid_dims(max_grid))
        block = f("block", st.sampled_from([[1], [16], [64], [8, 8], [4, 4, 4]]), block_dims(max_block))
        stream, owned = self.stream(draw, sess, f)
        if f.sane("args"):
            args, bad_arg = self._sane_args(draw, sess, f, name), False
        else:
            args, bad_arg = self._wild_args(draw, sess, f)
        bad_arg = bad_arg or any(a.HasField("buffer") and not self._owned_view(sess, a.buffer) for a in args)
        shared_mem = f("shared_mem", st.just(1024 if name == "fz_local" else 0),
                       st.sampled_from([0, 16, 1024, 1 << 20, 2**64 - 1]))
        dims_bad = any(not 1 <= len(d) <= 3 or any(not 1 <= x <= limit for x in d)
                       for d, limit in ((grid, max_grid), (block, max_block)))
        bad = sess is None or name is None or not owned or bad_arg or dims_bad
        request = pb.LaunchKernelRequest(session=session, kernel=handle, grid=grid, block=block,
                                         shared_mem=shared_mem, stream=stream, args=args)
        return request, bad, lambda: None

    @staticmethod
    def _owned_view(sess: Sess | None, ref: pb.BufferRef) -> bool:
        buf = sess.bufs.get(ref.handle) if sess else None
        return buf is not None and ref.offset <= buf.size

    def step_launch(self, draw: Draw) -> None:
        self.built_step(draw, "LaunchKernel", self.launch_request, "invalid caller, kernel, stream, dims or args")

    # -- streams ----------------------------------------------------------------------------------
    def step_create_stream(self, draw: Draw) -> None:
        token, session, sess = self.caller(draw)
        resp, code, _ = self.call("CreateStream", pb.SessionRequest(session=session), token)
        self.refused("CreateStream", code, "the caller does not own the session", sess is None)
        self.lost(code, sess)
        if code == "OK" and sess is not None:
            sess.streams.add(resp.handle)

    def step_destroy_stream(self, draw: Draw) -> None:
        token, session, sess = self.caller(draw)
        handle, owned = self.handle(draw, sess, "stream", draw(st.booleans()))
        _, code, _ = self.call("DestroyStream", pb.StreamRequest(session=session, stream=handle), token)
        self.refused("DestroyStream", code, f"{handle!r} is no live stream of the session", sess is None,
                     owned is None)
        self.lost(code, sess)
        if code == "OK" and sess is not None and owned is not None:
            self.model.destroy_stream(sess, handle)

    def step_synchronize(self, draw: Draw) -> None:
        token, session, sess = self.caller(draw)
        stream, owned = self.stream(draw, sess, Fields(draw, ["stream"]))
        _, code, _ = self.call("Synchronize", pb.StreamRequest(session=session, stream=stream), token)
        self.refused("Synchronize", code, "invalid caller or stream", sess is None, not owned)
        self.lost(code, sess)
        if code == "OK" and sess is not None:
            sess.settle(stream or None)

    # -- asynchronous command batches -------------------------------------------------------------
    def step_commands(self, draw: Draw) -> None:
        token, session, sess = self.caller(draw)
        seq = draw(st.integers(0, 2**40))
        batches: list[pb.CommandBatch] = []
        plans: list[list[tuple[int, bool, Callable[[], None] | None]]] = []
        for number in range(draw(st.integers(1, 3))):
            named = session if number == 0 else draw(st.sampled_from([session, "", "ses_nope"]))
            commands, plan = [], []
            for _ in range(draw(st.integers(0, 4))):
                seq += 1
                kind = draw(st.sampled_from(["launch", "memset", "copy_d2d", "empty"]))
                if kind == "empty":
                    commands.append(pb.Command(seq=seq))
                    plan.append((seq, True, None))
                    continue
                build = {"launch": self.launch_request, "memset": self.memset_request,
                         "copy_d2d": self.d2d_request}[kind]
                request, bad, effect = build(draw, "", sess)
                commands.append(pb.Command(seq=seq, **{kind: request}))
                plan.append((seq, bad, effect))
            batches.append(pb.CommandBatch(session=named, batch=number, commands=commands))
            plans.append(plan)
        acks: list[pb.BatchAck] = []
        self.steps += 1
        try:
            for ack in self.stub.Commands(iter(batches), metadata=self._md(token), timeout=self.timeout):
                acks.append(ack)
            code, details = "OK", ""
        except grpc.RpcError as err:
            code, details = err.code().name, err.details() or ""
        self.observe("Commands", code, details, batches)
        self.lost(code, sess)
        if acks and sess is None:
            self.expect_refused("Commands", "OK", "the caller does not own the session")
        for ack, plan in zip(acks, plans, strict=False):
            failed = ack.error.seq if ack.HasField("error") else None
            if failed is not None:
                self.observe("Commands ack", ack.error.code, ack.error.message, ack)
                self.lost(ack.error.code, sess)
            for command_seq, bad, effect in plan:
                if failed is not None and command_seq >= failed:
                    break
                if bad:
                    self.expect_refused("Commands", "OK", f"command {command_seq} of batch {ack.batch} is invalid")
                if effect is not None and sess is not None and not sess.lost:
                    effect()

    # -- the Admin service ------------------------------------------------------------------------
    def step_admin(self, draw: Draw) -> None:
        who = draw(st.sampled_from(["admin", "admin", "tenant", "none"]))
        token = {"admin": self.admin_token, "none": ""}.get(who) or draw(st.sampled_from(list(self.tokens.values())))
        method = draw(st.sampled_from(["ListSessions", "Usage", "Status", "EndSession", "EndSession"]))
        ended = None
        if method == "ListSessions":
            request: Any = apb.ListSessionsRequest(tenant=draw(st.sampled_from([*self.tokens, "", "nobody", "\x00"])))
        elif method == "Usage":
            request = apb.UsageRequest(window_seconds=draw(st.one_of(
                st.floats(), st.sampled_from([0.0, -1.0, math.inf, -math.inf, math.nan, 1e308, 5e-324]))))
        elif method == "Status":
            request = apb.StatusRequest()
        else:
            sessions = list(self.model.sessions.values())
            ended = draw(st.sampled_from(sessions)) if sessions and draw(st.booleans()) else None
            name = ended.id if ended else draw(st.sampled_from([*self.model.dead_sessions, "", "ses_nope"]))
            request = apb.EndSessionRequest(session=name)
        self.steps += 1
        try:
            getattr(self.admin, method)(request, metadata=self._md(token), timeout=self.timeout)
            code, details = "OK", ""
        except grpc.RpcError as err:
            code, details = err.code().name, err.details() or ""
        self.observe(f"Admin.{method}", code, details, request)
        self.refused(f"Admin.{method}", code, "the caller is no admin", who != "admin")
        if method == "EndSession":
            self.refused("Admin.EndSession", code, "no such live session", ended is None)
            if code == "OK" and ended is not None:
                self.model.close(ended)

    # -- messages that are not protobuf -----------------------------------------------------------
    def step_raw_request(self, draw: Draw) -> None:
        method = draw(st.sampled_from(_RAW_UNARY + list(_RAW_STREAMING)))
        token = draw(st.sampled_from(list(self.tokens.values())))
        messages = draw(st.lists(st.binary(max_size=48), min_size=1, max_size=3))
        kind = _RAW_STREAMING.get(method, "unary_unary")
        call = getattr(self.channel, kind)(f"/gpubroker.v1.GpuBroker/{method}", request_serializer=None,
                                           response_deserializer=None)
        self.steps += 1
        try:
            request = messages[0] if kind.startswith("unary") else iter(messages)
            response = call(request, metadata=self._md(token), timeout=self.timeout)
            if kind.endswith("stream"):
                list(response)
            code, details = "OK", ""
        except grpc.RpcError as err:
            code, details = err.code().name, err.details() or ""
        self.observe(f"raw {method}", code, details, messages)
