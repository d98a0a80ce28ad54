"""Fuzz the gRPC API through raw stubs: random and invalid fields, hostile sequences, interleaved sessions.

A case opens a session, runs a few random steps (each one RPC, or a shared-memory segment request), checks that the
broker's accounting agrees with the model exactly, and closes what it opened. Every answer must be OK or one of
the documented statuses; a call that names a session or handle it does not own must fail; bytes read back must
be those written (see _model.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc
from hypothesis import strategies as st

from gpubroker.client._channel import make_channel
from gpubroker.v1 import admin_pb2 as apb
from gpubroker.v1 import admin_pb2_grpc as apb_grpc
from gpubroker.v1 import broker_pb2 as pb
from gpubroker.v1 import broker_pb2_grpc as pb_grpc
from gpubroker_bench.fuzz._model import ALLOWED_CODES, Buf, Model, Sess
from gpubroker_bench.fuzz._steps import StepsMixin
from gpubroker_bench.fuzz._values import FUZZ_KERNELS, fuzz_source

__all__ = ["FuzzFailure", "GrpcFuzzer"]

Draw = Callable[..., Any]


class FuzzFailure(AssertionError):
    """The broker broke a promise: an undocumented status, a foreign handle accepted, a wrong byte, a leak."""


class GrpcFuzzer(StepsMixin):
    """Drives one broker; ``run_case(data)`` runs one hypothesis-drawn case (``data`` is ``st.data()``)."""

    def __init__(self, target: str, tokens: dict[str, str], admin_token: str, limits: dict[str, Any],
                 *, timeout: float = 60.0, max_steps: int = 8, compile_odds: int = 2) -> None:
        self.target = target
        self.tokens = tokens
        self.admin_token = admin_token
        self.limits = limits
        self.timeout = timeout
        self.max_steps = max_steps
        # One case in this many builds the fuzz kernels up front (a build costs tens of ms even when cached).
        self.compile_odds = compile_odds
        self.channel, _ = make_channel(target, None)
        self.stub = pb_grpc.GpuBrokerStub(self.channel)
        self.admin = apb_grpc.AdminStub(self.channel)
        self.model = Model(tokens)
        self.statuses: Counter[str] = Counter()  # "Method CODE" -> count
        self.cases = 0
        self.steps = 0
        devices = self.stub.ListDevices(pb.ListDevicesRequest(), metadata=self._md(admin_token), timeout=timeout)
        self.devices = list(devices.devices)
        self.backend = self.devices[0].backend
        self.observers: dict[str, str] = {}
        for tenant in tokens:
            self.observers[tenant] = self._open_observer(tenant)

    # -- plumbing ----------------------------------------------------------------------------------
    @staticmethod
    def _md(token: str) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {token}"),) if token else ()

    def call(self, method: str, request: Any, token: str, stream: bool = False) -> tuple[Any, str, str]:
        """(response or None, status name, details); fails the case on an undocumented status."""
        self.steps += 1
        try:
            fn = getattr(self.stub, method)
            response = fn(request, metadata=self._md(token), timeout=self.timeout)
            if stream:
                response = list(response)
            code, details = "OK", ""
        except grpc.RpcError as err:
            response, code, details = None, err.code().name, err.details() or ""
        return response, self.observe(method, code, details, request), details

    def observe(self, method: str, code: str, details: str, request: Any = None) -> str:
        self.statuses[f"{method} {code}"] += 1
        if code != "OK" and code not in ALLOWED_CODES:
            raise FuzzFailure(f"{method} answered {code} ({details!r}) to {str(request)[:2000]}")
        return code

    def expect_refused(self, method: str, code: str, why: str) -> None:
        if code == "OK":
            raise FuzzFailure(f"{method} succeeded though {why}")

    def _open_observer(self, tenant: str) -> str:
        return self.open_session(self.tokens[tenant])

    def open_session(self, token: str) -> str:
        """A session the cases do not touch (an observer, or the raw sockets' session)."""
        resp = self.stub.OpenSession(pb.OpenSessionRequest(device=0, client_name="fuzz-observer"),
                                     metadata=self._md(token), timeout=self.timeout)
        return str(resp.session)

    def check_raw_session(self, session: str) -> None:
        """The raw sockets' session holds no memory: what they registered was released, what they allocated was
        freed (the front counts no handles any more: the worker resolves them)."""
        listed = self.admin.ListSessions(apb.ListSessionsRequest(), metadata=self._md(self.admin_token),
                                         timeout=self.timeout)
        rows = [s for s in listed.sessions if s.session == session]
        if not rows or rows[0].memory_used != 0 or rows[0].lost:
            raise FuzzFailure(f"the raw sockets' session: {rows[0] if rows else 'gone'}")

    def close(self) -> None:
        self.channel.close()

    # -- choosing callers and handles --------------------------------------------------------------
    def caller(self, draw: Draw) -> tuple[str, str, Sess | None]:
        """(token, session id, the model session the call acts on, or None when it must be refused)."""
        sessions = list(self.model.sessions.values())
        how = draw(st.sampled_from(["own"] * 20 + ["other_tenant", "no_token", "bad_token", "dead_session",
                                                   "junk_session", "foreign_session"]))
        tenants = list(self.tokens)
        if how == "own" and sessions:
            sess = draw(st.sampled_from(sessions))
            return self.tokens[sess.tenant], sess.id, sess
        if how == "other_tenant" and sessions:
            sess = draw(st.sampled_from(sessions))
            other = draw(st.sampled_from([t for t in tenants if t != sess.tenant]))
            return self.tokens[other], sess.id, None
        if how == "no_token" and sessions:
            return "", draw(st.sampled_from(sessions)).id, None
        if how == "bad_token" and sessions:
            sess = draw(st.sampled_from(sessions))
            token = self.tokens[sess.tenant]
            return draw(st.sampled_from([token[:-4] + "AAAA", "gpb_x_y", token + "x", "Bearer"])), sess.id, None
        tenant = draw(st.sampled_from(tenants))
        if how == "dead_session" and self.model.dead_sessions:
            return self.tokens[tenant], draw(st.sampled_from(self.model.dead_sessions)), None
        if how == "foreign_session":
            other = draw(st.sampled_from([t for t in tenants if t != tenant]))
            return self.tokens[tenant], self.observers[other], None
        return self.tokens[tenant], draw(st.sampled_from(["", "ses_", "ses_nope", "\x00" * 8])), None

    def handle(self, draw: Draw, sess: Sess | None, kind: str, sane: bool = False) -> tuple[str, Any]:
        """A handle to name in a request, and the model's object when it is a live one of ``kind`` in ``sess``.

        ``sane``: one of the session's own when it has any; else sometimes another session's, a dead one or junk.
        """
        own: dict[str, Any] = {}
        if sess is not None:
            own = {"buf": sess.bufs, "module": sess.modules, "kernel": sess.kernels,
                   "stream": {h: h for h in sess.streams}, "segment": sess.segs}[kind]
        if sane and own:
            handle = draw(st.sampled_from(list(own)))
            return handle, own[handle]
        others = [h for s in self.model.sessions.values() for h in s.handles() if h not in own]
        pools: list[list[str]] = [list(own)] * 3 + [others, self.model.dead_handles]
        pool = draw(st.sampled_from([p for p in pools if p] or [[]]))
        if pool:
            handle = draw(st.sampled_from(pool))
        else:
            handle = draw(st.sampled_from(["", "buf_x", "krn_", "seg1", "str_0", "mod_" + "A" * 22]))
        return handle, own.get(handle)

    # -- cases ------------------------------------------------------------------------------------
    def run_case(self, data: Any) -> None:
        draw = data.draw
        # Nothing a case draws may depend on earlier cases: hypothesis replays and extends cases, and requires the
        # same draws to lead to the same choices.
        self.model.dead_sessions.clear()
        self.model.dead_handles.clear()
        tenant = draw(st.sampled_from(list(self.tokens)), label="tenant")
        finished = False
        try:
            resp, code, _ = self.call("OpenSession", pb.OpenSessionRequest(device=0), self.tokens[tenant])
            if code == "OK":
                sess = self.model.open(resp.session, tenant)
                if draw(st.integers(0, 4), label="setup"):
                    self.setup(draw, sess)
            for _ in range(draw(st.integers(1, self.max_steps), label="steps")):
                step = draw(st.sampled_from(self.STEPS), label="step")
                getattr(self, f"step_{step}")(draw)
            self.check_accounting()
            finished = True
        finally:
            # Also when hypothesis cuts a case short (it stops one that draws too much): the next starts clean.
            for sess in list(self.model.sessions.values()):
                _, code, _ = self.call("CloseSession", pb.SessionRequest(session=sess.id), self.tokens[sess.tenant])
                if code != "OK" and finished:
                    raise FuzzFailure(f"closing session {sess.id} at the end of a case: {code}")
                self.model.close(sess)
        self.cases += 1
        # Everything the case held is freed: each ledger back where it was (the workers' own every 10 cases).
        self.check_accounting(workers=self.cases % 10 == 0)

    def setup(self, draw: Draw, sess: Sess) -> None:
        """Valid objects to start from (random steps alone seldom build a buffer, a kernel and a segment)."""
        token = self.tokens[sess.tenant]
        for size in draw(st.lists(st.sampled_from([64, 1000, 4096, 65536, 256 << 10]), min_size=1, max_size=3)):
            resp, code, _ = self.call("Allocate", pb.AllocateRequest(session=sess.id, size=size), token)
            if code == "OK":
                sess.bufs[resp.handle] = Buf(resp.handle, size)
        if not draw(st.integers(0, self.compile_odds - 1)):
            native = pb.MODULE_FORMAT_CUDA_C if self.backend == "cuda" else pb.MODULE_FORMAT_OPENCL_C
            module, code, details = self.call("LoadModule", pb.LoadModuleRequest(
                session=sess.id, format=native, image=fuzz_source(self.backend).encode()), token)
            if code != "OK":
                raise FuzzFailure(f"the fuzz kernels did not load: {code} {details}")
            sess.modules[module.handle] = list(module.kernel_names)
            for name in draw(st.lists(st.sampled_from(FUZZ_KERNELS), min_size=1, max_size=2, unique=True)):
                kernel, code, _ = self.call("GetKernel", pb.GetKernelRequest(session=sess.id, module=module.handle,
                                                                            name=name), token)
                if code == "OK":
                    sess.kernels[kernel.handle] = name
        if draw(st.booleans()):
            self.step_register_segment(draw, caller=(token, sess.id, sess), size=65536)
        if not draw(st.integers(0, 3)):
            stream, code, _ = self.call("CreateStream", pb.SessionRequest(session=sess.id), token)
            if code == "OK":
                sess.streams.add(stream.handle)

    # -- invariants -------------------------------------------------------------------------------
    def tenant_view(self, tenant: str) -> pb.DeviceInfo:
        """The tenant's device view through its observer session (reopened if a worker crash lost it)."""
        for _ in range(2):
            info, code, details = self.call("GetDeviceInfo", pb.SessionRequest(session=self.observers[tenant]),
                                            self.tokens[tenant])
            if code == "OK":
                return info
            if code not in ("ABORTED", "NOT_FOUND"):
                raise FuzzFailure(f"the observer of {tenant} got {code}: {details}")
            if code == "ABORTED":  # the tenant's worker died (a case crashed it): its sessions lost everything
                self.model.worker_lost(tenant)
            self.stub.CloseSession(pb.SessionRequest(session=self.observers[tenant]),
                                   metadata=self._md(self.tokens[tenant]), timeout=self.timeout)
            self.observers[tenant] = self._open_observer(tenant)
        raise FuzzFailure(f"no device view for tenant {tenant}")

    def check_tenant(self, tenant: str, info: pb.DeviceInfo) -> None:
        expected = self.model.tenant_memory(tenant)
        if info.memory_used != expected:
            raise FuzzFailure(f"tenant {tenant}: the broker counts {info.memory_used} bytes used, the model {expected}")
        if self.backend == "opencl" and info.total_memory - info.free_memory != expected:
            # PoCL's free memory is the worker's own ledger: the tenant's real allocations, not the front's count.
            raise FuzzFailure(f"tenant {tenant}: its worker holds {info.total_memory - info.free_memory} bytes, "
                              f"the model {expected}")

    def check_accounting(self, workers: bool = True) -> None:
        """Each tenant's memory, and each session's memory, exactly as the model says; with
        ``workers``, each tenant's view through its worker too."""
        for tenant in self.tokens if workers else ():
            self.check_tenant(tenant, self.tenant_view(tenant))
        usage = self.admin.Usage(apb.UsageRequest(), metadata=self._md(self.admin_token), timeout=self.timeout)
        for row in usage.tenants:
            expected = self.model.tenant_memory(row.tenant)
            if row.tenant in self.tokens and row.device == 0 and row.memory_used != expected:
                raise FuzzFailure(f"admin usage: {row.tenant} uses {row.memory_used} bytes, the model {expected}")
        listed = self.admin.ListSessions(apb.ListSessionsRequest(), metadata=self._md(self.admin_token),
                                         timeout=self.timeout)
        seen = {s.session: s for s in listed.sessions}
        for row in listed.sessions:
            if row.lost and row.session in self.model.sessions:
                self.model.worker_lost(row.tenant)
        for sess in self.model.sessions.values():
            row = seen.get(sess.id)
            if row is None:
                raise FuzzFailure(f"session {sess.id} of {sess.tenant} is gone from the broker")
            if row.memory_used != sess.memory:
                raise FuzzFailure(f"session {sess.id}: the broker has {row.memory_used} bytes, the model "
                                  f"{sess.memory}")
        ours = set(self.model.sessions) | set(self.observers.values())
        strays = [s.session for s in listed.sessions if s.tenant in self.tokens and s.session not in ours]
        if strays:
            raise FuzzFailure(f"sessions the fuzzer never opened or already closed: {strays}")

    def broker_alive(self) -> bool:
        try:
            self.stub.ListDevices(pb.ListDevicesRequest(), metadata=self._md(self.admin_token), timeout=10)
        except grpc.RpcError:
            return False
        return True
