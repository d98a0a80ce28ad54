"""The same-host fast path: raw-socket calls with the gRPC front's authentication, results and errors."""

from __future__ import annotations

import numpy as np
import pytest

from gpubroker.broker import samples
from gpubroker.broker.launcher import BrokerProcess
from gpubroker.client import InvalidArgument, NotFound, Unauthenticated, connect
from gpubroker.client._fast import FastChannel


def _fast_path(broker: BrokerProcess) -> str:
    return broker.target.removeprefix("unix:") + ".fast"


def test_local_clients_take_the_fast_path_with_the_same_results(broker: BrokerProcess) -> None:
    for fast in (True, False):
        with connect(broker.target, token=broker.tokens["alice"], fast_path=fast) as gpu:
            assert (gpu._fast is not None) == fast
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
