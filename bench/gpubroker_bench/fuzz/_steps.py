"""The fuzzer's steps for sessions, memory and copies; each draws a request, sends it and checks the answer.

A step applies what a successful call did to the model. A call whose caller, handle or range the model knows to
be invalid must fail; one the model cannot judge (limits, device checks) may go either way.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from typing import Any, TypeVar

from hypothesis import strategies as st

from gpubroker.client import GpuBrokerError
from gpubroker.client._shm import SegmentChannel, create_segment_fd
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.wire.addresses import unix_path
from gpubroker.wire.commands import new_handle
from gpubroker.wire.link import RegisterSegment, ReleaseSegment, SegmentRegistered, SegmentReleased
from gpubroker_bench.fuzz._fields import Fields, payload
from gpubroker_bench.fuzz._model import Buf, Sess
from gpubroker_bench.fuzz._steps_code import CodeStepsMixin
from gpubroker_bench.fuzz._values import int64s, uint32s, uint64s

__all__ = ["StepsMixin"]

Draw = Callable[..., Any]
T = TypeVar("T")


class StepsMixin(CodeStepsMixin):
    STEPS = (["open", "close", "heartbeat", "device_info", "list_devices", "load_module", "create_stream",
              "destroy_stream", "register_segment", "release_segment", "admin", "raw_request"]
             + ["allocate"] * 3 + ["free"] * 2 + ["memset"] * 3 + ["copy_d2d"] * 3 + ["copy_h2d"] * 4
             + ["copy_d2h"] * 4 + ["get_kernel"] * 2 + ["launch"] * 4 + ["synchronize"] * 2 + ["commands"] * 3
             + ["copy_shared"] * 4)

    # -- shared pieces ---------------------------------------------------------------------------
    def ref(self, draw: Draw, sess: Sess | None, f: Fields, name: str) -> tuple[pb.BufferRef, Buf | None, int]:
        """A buffer reference: (message, the model's buffer if it is one of ``sess``'s, view offset)."""
        handle, buf = self.handle(draw, sess, "buf", f.sane(name))
        size = buf.size if buf else 0
        views = [0, 0, *range(128, size, 128 * max(1, size // 1024))][:12]  # (OpenCL takes aligned views only)
        view_offset = f(f"{name} view", st.sampled_from(views), uint64s([0, 128, size, size + 1]))
        return pb.BufferRef(handle=handle, offset=view_offset), buf, view_offset

    def stream(self, draw: Draw, sess: Sess | None, f: Fields) -> tuple[str, bool]:
        """A stream handle ("" is the default stream) and whether ``sess`` owns it."""
        if f.sane("stream"):
            own = sorted(sess.streams) if sess else []
            return draw(st.sampled_from(["", "", *own])), True
        handle, owned = self.handle(draw, sess, "stream")
        return handle, owned is not None or handle == ""

    def lost(self, code: str, sess: Sess | None) -> None:
        if code == "ABORTED" and sess is not None:
            self.model.worker_lost(sess.tenant)

    def write(self, sess: Sess, buf: Buf, start: int, payload: bytes | bytearray | memoryview, stream: str,
              asynchronous: bool, known: bytes | bytearray | None = None) -> None:
        """What a successful write did to the model's bytes (see _model.py on racing streams)."""
        n = len(payload)
        if sess.racy(stream):
            buf.forget(start, n)
            sess.racing_write(stream)
        else:
            buf.set(start, payload, known)
        if not asynchronous:
            sess.settle(stream)
        elif n:
            sess.inflight.add(stream)

    def read(self, sess: Sess, buf: Buf, start: int, got: bytes | bytearray | memoryview, stream: str,
             what: str) -> None:
        """A successful blocking read: the bytes the model knows must be there."""
        if not sess.racy(stream):
            bad = buf.mismatch(start, got)
            if bad is not None:
                from gpubroker_bench.fuzz._grpc import FuzzFailure

                raise FuzzFailure(f"{what}: byte {bad} of buffer {buf.handle} reads {got[bad - start]}, "
                                  f"the model has {buf.data[bad]}")
        sess.settle(stream)

    def refused(self, method: str, code: str, why: str, *conditions: bool) -> None:
        """The call must have failed if any of ``conditions`` holds."""
        if any(conditions):
            self.expect_refused(method, code, why)

    # -- sessions ---------------------------------------------------------------------------------
    def step_open(self, draw: Draw) -> None:
        tenant = draw(st.sampled_from(list(self.tokens)))
        token = draw(st.sampled_from([self.tokens[tenant]] * 4 + ["", "gpb_x_y"]))
        device = draw(st.sampled_from([0] * 6 + [len(self.devices), 7, 2**32 - 1]))
        resp, code, _ = self.call("OpenSession", pb.OpenSessionRequest(
            device=device, client_name=draw(st.text(max_size=40))), token)
        self.refused("OpenSession", code, "bad token or device", token != self.tokens[tenant],
                     device >= len(self.devices))
        if code == "OK":
            if device != 0:  # (a broker with several devices) not the device the model follows
                self.call("CloseSession", pb.SessionRequest(session=resp.session), token)
                return
            self.model.open(resp.session, tenant)

    def step_close(self, draw: Draw) -> None:
        token, session, sess = self.caller(draw)
        _, code, _ = self.call("CloseSession", pb.SessionRequest(session=session), token)
        self.refused("CloseSession", code, "the caller does not own the session", sess is None)
        if code == "OK" and sess is not None:
            self.model.close(sess)

    def step_heartbeat(self, draw: Draw) -> None:
        token, session, sess = self.caller(draw)
        _, code, _ = self.call("Heartbeat", pb.SessionRequest(session=session), token)
        self.refused("Heartbeat", code, "the caller does not own the session", sess is None)
        self.lost(code, sess)

    def step_device_info(self, draw: Draw) -> None:
        token, session, sess = self.caller(draw)
        info, code, _ = self.call("GetDeviceInfo", pb.SessionRequest(session=session), token)
        self.refused("GetDeviceInfo", code, "the caller does not own the session", sess is None)
        self.lost(code, sess)
        if code == "OK" and sess is not None:
            self.check_tenant(sess.tenant, info)

    def step_list_devices(self, draw: Draw) -> None:
        token = draw(st.sampled_from([*self.tokens.values(), "", "gpb_x_y"]))
        _, code, _ = self.call("ListDevices", pb.ListDevicesRequest(), token)
        self.refused("ListDevices", code, "no valid token", token not in self.tokens.values())

    # -- memory -----------------------------------------------------------------------------------
    def step_allocate(self, draw: Draw) -> None:
        token, session, sess = self.caller(draw)
        quota = self.limits["quotas"][sess.tenant] if sess else 0
        used = self.model.tenant_memory(sess.tenant) if sess else 0
        room = quota - used
        size = draw(st.one_of(st.integers(1, max(1, min(room, 1 << 16))), int64s([room, room + 1, 1 << 16])))
        resp, code, _ = self.call("Allocate", pb.AllocateRequest(session=session, size=size), token)
        self.refused("Allocate", code, f"size {size} with {used} of {quota} used", sess is None,
                     size <= 0, used + size > quota)
        self.lost(code, sess)
        if code == "OK" and sess is not None:
            if resp.size != size:
                self.expect_refused("Allocate", "OK", f"it answered size {resp.size} for {size}")
            sess.bufs[resp.handle] = Buf(resp.handle, size)

    def step_free(self, draw: Draw) -> None:
        token, session, sess = self.caller(draw)
        handle, buf = self.handle(draw, sess, "buf", draw(st.booleans()))
        _, code, _ = self.call("Free", pb.FreeRequest(session=session, buffer=handle), token)
        self.refused("Free", code, f"{handle!r} is no live buffer of the session", sess is None, buf is None)
        self.lost(code, sess)
        if code == "OK" and sess is not None and buf is not None:
            self.model.free(sess, handle)

    def memset_request(self, draw: Draw, session: str, sess: Sess | None
                       ) -> tuple[pb.MemsetRequest, bool, Callable[[], None]]:
        """(request, whether it must fail, what it does when it succeeds)."""
        f = Fields(draw, ["buf", "buf view", "stream", "offset", "size", "value"])
        ref, buf, voff = self.ref(draw, sess, f, "buf")
        stream, owned = self.stream(draw, sess, f)
        view = buf.size - voff if buf else 0
        offset = f("offset", st.integers(0, max(view, 0)), int64s([0, view // 2, view, view + 1]))
        rest = view - offset
        size = f("size", st.one_of(st.just(-1), st.integers(0, max(rest, 0))),
                 int64s([-1, rest, rest // 2, rest + 1]))
        value = f("value", st.integers(0, 255), uint32s([0, 7, 255, 256]))
        n = max(rest, 0) if size < 0 else size
        start = voff + offset
        bad = (sess is None or buf is None or not owned or voff > (buf.size if buf else 0) or value > 255
               or offset < 0 or start + n > (buf.size if buf else 0))

        def effect() -> None:
            assert sess is not None and buf is not None
            self.write(sess, buf, start, bytes([value]) * n, stream, asynchronous=True)

        request = pb.MemsetRequest(session=session, buffer=ref, offset=offset, size=size, value=value, stream=stream)
        return request, bad, effect

    def step_memset(self, draw: Draw) -> None:
        self.built_step(draw, "Memset", self.memset_request, "invalid caller, buffer, stream, value or range")

    def d2d_request(self, draw: Draw, session: str, sess: Sess | None
                    ) -> tuple[pb.CopyDeviceToDeviceRequest, bool, Callable[[], None]]:
        f = Fields(draw, ["src", "src view", "dst", "dst view", "stream", "src_offset", "dst_offset", "size"])
        src_ref, src, svoff = self.ref(draw, sess, f, "src")
        dst_ref, dst, dvoff = self.ref(draw, sess, f, "dst")
        stream, owned = self.stream(draw, sess, f)
        sview = src.size - svoff if src else 0
        dview = dst.size - dvoff if dst else 0
        src_offset = f("src_offset", st.integers(0, max(sview, 0)), int64s([0, sview // 2, sview]))
        dst_offset = f("dst_offset", st.integers(0, max(dview, 0)), int64s([0, dview // 2, dview]))
        room = min(sview - src_offset, dview - dst_offset)
        size = f("size", st.integers(0, max(room, 0)), int64s([room, room // 2, room + 1, 0]))
        s, d = svoff + src_offset, dvoff + dst_offset
        bad = (sess is None or src is None or dst is None or not owned or src_offset < 0 or dst_offset < 0
               or size < 0 or svoff > (src.size if src else 0) or dvoff > (dst.size if dst else 0)
               or s + size > (src.size if src else 0) or d + size > (dst.size if dst else 0))

        def effect() -> None:
            assert sess is not None and src is not None and dst is not None
            if not size:
                return
            if src is dst and s < d + size and d < s + size:  # an overlapping copy: undefined where allowed
                dst.forget(d, size)
                sess.racing_write(stream)
            else:
                self.write(sess, dst, d, src.data[s:s + size], stream, asynchronous=True,
                           known=src.known[s:s + size])
            sess.inflight.add(stream)
            sess.pending_copies.append((dst, d, size, stream))

        request = pb.CopyDeviceToDeviceRequest(session=session, src=src_ref, src_offset=src_offset, dst=dst_ref,
                                               dst_offset=dst_offset, size=size, stream=stream)
        return request, bad, effect

    def step_copy_d2d(self, draw: Draw) -> None:
        self.built_step(draw, "CopyDeviceToDevice", self.d2d_request, "invalid caller, buffers, stream or ranges")

    # -- host copies ------------------------------------------------------------------------------
    def step_copy_h2d(self, draw: Draw) -> None:
        token, session, sess = self.caller(draw)
        f = Fields(draw, ["buf", "buf view", "stream", "offset", "bytes", "announced", "layout"])
        ref, buf, voff = self.ref(draw, sess, f, "buf")
        stream, owned = self.stream(draw, sess, f)
        view = buf.size - voff if buf else 0
        offset = f("offset", st.integers(0, max(view, 0)), int64s([0, view, view // 2]))
        rest = view - offset
        chunk = self.limits["chunk_bytes"]
        n = f("bytes", st.one_of(st.integers(0, max(0, min(rest, 300))), st.just(max(rest, 0))),
              st.one_of(st.integers(0, 300), st.sampled_from([rest, chunk + 1, 2 * chunk + 3])))
        n = max(0, min(n, 4 << 20))
        data = payload(draw, n)
        announced = f("announced", st.just(n), st.sampled_from([n, n + 1, max(n - 1, 0), 0, -1]))
        layout = f("layout", st.just("chunks"), st.sampled_from(["chunks", "no_header", "late_header", "nothing",
                                                                  "oversized"]))
        header = pb.HostToDeviceHeader(session=session, buffer=ref, offset=offset, size=announced, stream=stream)
        pieces = [data[i:i + chunk] for i in range(0, n, chunk)] or [b""]
        if layout == "oversized":
            pieces = [data]
        messages = [pb.HostToDeviceChunk(data=p) for p in pieces]
        if layout in ("chunks", "oversized"):
            messages[0].header.CopyFrom(header)
        elif layout == "late_header":
            messages.append(pb.HostToDeviceChunk(header=header))
        elif layout == "nothing":
            messages = []
        start = voff + offset
        bad = (sess is None or buf is None or not owned or layout in ("no_header", "late_header", "nothing")
               or (layout == "oversized" and n > chunk) or announced != n or offset < 0
               or voff > (buf.size if buf else 0) or start + n > (buf.size if buf else 0))
        _, code, _ = self.call("CopyHostToDevice", iter(messages), token)
        self.refused("CopyHostToDevice", code, "invalid caller, buffer, stream, range or chunks", bad)
        self.lost(code, sess)
        if sess is None or buf is None or sess.lost or buf.handle not in sess.bufs:
            return
        if code == "OK":
            self.write(sess, buf, start, data, stream, asynchronous=False)
        elif offset >= 0 and start < buf.size:
            # Chunks before the one refused were written: those bytes are the data's or the old ones.
            buf.forget(start, min(n, buf.size - start))
            sess.racing_write(stream)

    def step_copy_d2h(self, draw: Draw) -> None:
        token, session, sess = self.caller(draw)
        f = Fields(draw, ["buf", "buf view", "stream", "offset", "size", "chunk"])
        ref, buf, voff = self.ref(draw, sess, f, "buf")
        stream, owned = self.stream(draw, sess, f)
        view = buf.size - voff if buf else 0
        offset = f("offset", st.integers(0, max(view, 0)), int64s([0, view, view // 2]))
        rest = view - offset
        size = f("size", st.integers(0, max(rest, 0)), int64s([rest, rest // 2, rest + 1, view]))
        limit = self.limits["chunk_bytes"]
        # (tiny chunks only for small copies: each chunk is a worker round trip)
        chunk = f("chunk", st.sampled_from([0, limit, 4096]),
                  st.sampled_from([0, limit, limit + 1, 2**64 - 1, 4096] + ([1, 7] if size <= 4096 else [])))
        request = pb.CopyDeviceToHostRequest(session=session, buffer=ref, offset=offset, size=size, chunk_bytes=chunk,
                                             stream=stream)
        chunks, code, _ = self.call("CopyDeviceToHost", request, token, stream=True)
        start = voff + offset
        self.refused("CopyDeviceToHost", code, "invalid caller, buffer, stream or range", sess is None, buf is None,
                     not owned, offset < 0, size < 0, voff > (buf.size if buf else 0),
                     start + size > (buf.size if buf else 0))
        self.lost(code, sess)
        if code == "OK" and sess is not None and buf is not None:
            got = b"".join(c.data for c in chunks)
            if len(got) != size:
                self.expect_refused("CopyDeviceToHost", "OK", f"it sent {len(got)} of {size} bytes")
            self.read(sess, buf, start, got, stream, "CopyDeviceToHost")

    # -- shared memory ----------------------------------------------------------------------------
    def side_call(self, what: str, token: str, session: str, request: Any, answer: type[T],
                  fds: list[int]) -> tuple[T | None, str]:
        """One segment request on a segments connection of its own, opened with ``token`` for ``session`` (whose
        hello is refused as the request would be)."""
        self.steps += 1
        try:
            channel = SegmentChannel(f"{unix_path(self.target)}.fast", token, session, timeout=self.timeout)
        except GpuBrokerError as exc:
            return None, self.observe(what, exc.code, exc.message, {"token": token, "session": session})
        try:
            return channel.request(request, answer, fds), self.observe(what, "OK", "")
        except GpuBrokerError as exc:
            return None, self.observe(what, exc.code, exc.message, request)
        finally:
            channel.close()

    def step_register_segment(self, draw: Draw, caller: tuple[str, str, Sess | None] | None = None,
                              size: int | None = None) -> None:
        token, session, sess = caller or self.caller(draw)
        if size is None:
            size = draw(st.sampled_from([4096, 65536, 1 << 20, self.limits["max_shared_bytes"] + 1]))
        fd = create_segment_fd(size)
        try:
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED)
            mm[:] = payload(draw, size)
            reply, code = self.side_call("SharedMemory register", token, session,
                                         RegisterSegment(new_handle("segment"), size), SegmentRegistered, [fd])
        finally:
            os.close(fd)
        self.refused("SharedMemory register", code, "the caller does not own the session", sess is None,
                     size > self.limits["max_shared_bytes"])
        self.lost(code, sess)
        if code == "OK" and reply is not None and sess is not None:
            from gpubroker_bench.fuzz._model import Seg

            sess.segs[reply.segment] = Seg(reply.segment, size, mm)
        else:
            mm.close()

    def step_release_segment(self, draw: Draw) -> None:
        token, session, sess = self.caller(draw)
        handle, seg = self.handle(draw, sess, "segment", draw(st.booleans()))
        _, code = self.side_call("SharedMemory release", token, session, ReleaseSegment(handle), SegmentReleased, [])
        self.refused("SharedMemory release", code, f"{handle!r} is no live segment of the session", sess is None,
                     seg is None)
        self.lost(code, sess)
        if code == "OK" and sess is not None and seg is not None:
            self.model.release_segment(sess, handle)

    def step_copy_shared(self, draw: Draw) -> None:
        token, session, sess = self.caller(draw)
        f = Fields(draw, ["segment", "buf", "buf view", "stream", "offset", "size", "segment_offset"])
        handle, seg = self.handle(draw, sess, "segment", f.sane("segment"))
        ref, buf, voff = self.ref(draw, sess, f, "buf")
        stream, owned = self.stream(draw, sess, f)
        view = buf.size - voff if buf else 0
        seg_size = seg.size if seg else 0
        offset = f("offset", st.integers(0, max(view, 0)), int64s([0, view, view // 2]))
        room = min(view - offset, seg_size)
        size = f("size", st.integers(0, max(room, 0)), int64s([room, room // 2, room + 1, view - offset, seg_size]))
        seg_offset = f("segment_offset", st.integers(0, max(seg_size - size, 0)),
                       uint64s([0, seg_size - size, (seg_size - size) // 2, seg_size]))
        to_device = draw(st.booleans())
        request = pb.CopySharedRequest(session=session, segment=handle, segment_offset=seg_offset, buffer=ref,
                                       offset=offset, size=size, to_device=to_device, stream=stream)
        _, code, _ = self.call("CopyShared", request, token)
        start = voff + offset
        self.refused("CopyShared", code, "invalid caller, segment, buffer, stream or range", sess is None,
                     seg is None, buf is None, not owned, offset < 0, size < 0, voff > (buf.size if buf else 0),
                     start + size > (buf.size if buf else 0), seg_offset + size > seg_size)
        self.lost(code, sess)
        if code != "OK" or sess is None or buf is None or seg is None:
            return
        if to_device:
            self.write(sess, buf, start, seg.mm[seg_offset:seg_offset + size], stream, asynchronous=False)
        else:
            self.read(sess, buf, start, seg.mm[seg_offset:seg_offset + size], stream, "CopyShared to the host")
