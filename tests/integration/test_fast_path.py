"""The same-host fast path: raw-socket calls with the gRPC front's authentication, results and errors."""

from __future__ import annotations

import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.broker.launcher import BrokerProcess
from gpubroker.broker.workers._direct import MAX_LINKS_PER_SESSION
from gpubroker.client import Buffer, InvalidArgument, Kernel, NotFound, OutOfRange, Unauthenticated, connect
from gpubroker.client._fast import FastChannel
from gpubroker.v1 import broker_pb2 as pb


def _fast_path(broker: BrokerProcess) -> str:
    return broker.target.removeprefix("unix:") + ".fast"


# Direct links to the worker; the front's fast path; plain gRPC.
_PATHS = [{"direct": True}, {"direct": False}, {"fast_path": False}]


def test_local_clients_take_the_fast_path_with_the_same_results(broker: BrokerProcess) -> None:
    for path in _PATHS:
        with connect(broker.target, token=broker.tokens["alice"], **path) as gpu:
            assert (gpu._fast is not None) == path.get("fast_path", True)
            assert (gpu._direct is not None) == path.get("direct", False)
            kernel = gpu.compile_kernel(samples.source(gpu.device_info().backend), "saxpy")
            n = 1000
            x = np.arange(n, dtype=np.float32)
            dx, dy = gpu.allocate_memory(x.nbytes), gpu.allocate_memory(x.nbytes)
            gpu.copy_h2d(x, dx)
            gpu.memset(dy, 0)
            gpu.copy_d2d(dx, dy, x.nbytes)  # y = x
            gpu.execute_kernel(kernel, (n + 127) // 128, 128, [np.float32(2), dx, dy, np.int32(n)])
            gpu.synchronize()
            out = np.empty_like(x)
            gpu.copy_d2h(dy, out)
            np.testing.assert_array_equal(out, 3 * x)
            with pytest.raises(InvalidArgument):  # errors come back the same way
                gpu.execute_kernel(kernel, 1, 128, [np.float32(2), dx])
            with pytest.raises(OutOfRange, match="past the end"):
                gpu.memset(Buffer(dx.handle, dx.size, x.nbytes + 1), 0, 1)
            with pytest.raises(NotFound, match="no kernel"):
                gpu.execute_kernel(Kernel("krn_invented", "saxpy"), 1, 1, [np.float32(2), dx, dy, np.int32(n)])


def test_fast_path_authenticates_like_the_front(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["alice"]) as alice:
        with pytest.raises(Unauthenticated, match="missing or invalid bearer token"):
            FastChannel(_fast_path(broker), "gpb_nope_nope", alice.session, 10)
        with pytest.raises(NotFound):  # bob may not drive alice's session, even knowing its id
            FastChannel(_fast_path(broker), broker.tokens["bob"], alice.session, 10)
        channel = FastChannel(_fast_path(broker), broker.tokens["alice"], alice.session, 10)
        with pytest.raises(InvalidArgument, match="unknown fast-path operation"):
            channel.call("format_disk", b"")
        channel.close()


def test_async_commands_over_the_fast_path_defer_their_errors(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["alice"], async_commands=True) as gpu:
        assert gpu._fast is not None
        kernel = gpu.compile_kernel(samples.source(gpu.device_info().backend), "scale_inplace")
        buf = gpu.allocate_memory(64 * 4)
        gpu.memset(buf, 0)
        for _ in range(300):  # more than one batch
            gpu.execute_kernel(kernel, 1, 64, [buf, np.float32(1), np.int32(64)])
        gpu.execute_kernel(kernel, 1, 64, [buf])
        with pytest.raises(InvalidArgument, match=r"launch of 'scale_inplace'"):
            gpu.synchronize()
        out = np.empty(64, dtype=np.float32)
        gpu.copy_d2h(buf, out)
        np.testing.assert_array_equal(out, 300.0)


def test_direct_links_are_bound_to_their_session(broker: BrokerProcess) -> None:
    """A link serves only the session the front authenticated it for, even for the same tenant's other handles."""
    with connect(broker.target, token=broker.tokens["alice"]) as one, \
            connect(broker.target, token=broker.tokens["alice"]) as two:
        assert one._direct is not None and two._direct is not None
        theirs = one.allocate_memory(64)
        with pytest.raises(NotFound, match="no buf"):
            two.memset(theirs, 1)
        link = FastChannel(_fast_path(broker), broker.tokens["alice"], two.session, 10, direct=True)
        assert link.direct
        malformed = [("format_disk", {}, InvalidArgument), ("launch", [1, 2], InvalidArgument),
                     ("memset", {"buf": "x"}, InvalidArgument), ("launch", {"kernel": 3}, NotFound),
                     ("synchronize", {"stream": ["x"]}, NotFound), ("batch", {"commands": 7}, InvalidArgument)]
        for op, params, error in malformed:
            with pytest.raises(error):
                link.call(op, params)
        link.close()
        one.memset(theirs, 1)  # the worker lived through all of it
        one.synchronize()


def test_direct_links_per_session_are_bounded(broker: BrokerProcess) -> None:
    """Past the limit, new connections are served by the front (whose per-session call limits apply)."""
    with connect(broker.target, token=broker.tokens["bob"]) as gpu:
        links = [FastChannel(_fast_path(broker), broker.tokens["bob"], gpu.session, 10, direct=True)
                 for _ in range(MAX_LINKS_PER_SESSION)]
        assert sum(link.direct for link in links) == MAX_LINKS_PER_SESSION - 1  # the client's own is the first
        assert not links[-1].direct
        for link in links:
            link.close()


def test_an_ended_session_is_reported_by_the_front_not_as_a_lost_link(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["bob"]) as gpu:
        assert gpu._direct is not None
        gpu.synchronize()
        gpu._stub.CloseSession(pb.SessionRequest(session=gpu.session), metadata=gpu._metadata)  # ended elsewhere
        with pytest.raises(NotFound, match="session"):
            gpu.synchronize()
