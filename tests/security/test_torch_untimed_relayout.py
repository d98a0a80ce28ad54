"""Work the torch device does for a command is timed as the tenant's device work (issue 21, round 10; was: charged to
nobody).

On a CPU device (PoCL) a tenant's fence charge is ``min(what its worker reports, what the front's CPU meter
measured)`` (scheduler/_device.py ``_switch``): the worker's own figure can only lower it. The worker's figure for
the torch device is ``CpuPlacement``'s ``_Timed``, which brackets only ``info.overload(...)``. What
``TorchSession._outputs`` does afterwards is outside it: where an output's layout differs from the strides the
client announced, ``_as_announced`` makes a new tensor of the announced strides and copies the output into it
(``empty_strided`` + ``copy_``), as much work as the operator itself or far more.

A hostile client announces a contiguous layout for a view: ``aten::alias.default`` of an expanded 128 MiB view
(stride 0, no memory) announced with stride 1 is a 128 MiB allocation and fill per command, none of it timed.
Measured on PoCL, a lone tenant: 20 such commands took 0.68 s of wall time and were charged 0.0012 s of device
time; the same 20 materializations as ``aten::clone.default`` (timed) were charged 0.51-1.07 s. So a tenant alone on the
device (nobody waiting, so ``contended`` adds nothing) has its usage (Admin Usage, ``gpubroker_device_seconds``)
and its fair-queuing clock under-counted by ~400x.

The fix: the copy is made inside the placement's timer, on the session's stream (as the operator). Suggested then:
bracket the whole of a torch command's device-side work (``_outputs``/``_as_announced``, ``_keep``,
``from_buffer``'s reshape, ``to_buffer``'s copy) with ``placement.running``; or refuse an announced layout that
differs from the real output's for an aliasing return (a view is made by the real view operator: a different
layout is a lie) rather than copying.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import connect
from gpubroker.client._admin import AdminClient
from gpubroker.client._remote import RemoteGpu
from gpubroker.wire.torch import MemoryFormatArg, TensorArg, TorchOp
from tests.helpers import wait_for

N = 32 << 20  # float32: 128 MiB per materialization
ROUNDS = 20


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with BrokerProcess([TenantSpec("mallory", memory_quota=256 << 20), TenantSpec("ops", admin=True)],
                       backend="opencl") as b:
        yield b


def _charged(broker: BrokerProcess) -> float:
    with AdminClient(broker.target, broker.tokens["ops"]) as admin:
        usage = admin.usage()
    return sum(u.device_seconds for u in usage.tenants if u.tenant == "mallory")


def _settled(broker: BrokerProcess, before: float) -> float:
    """The charge once the scheduler's periodic accounting fence (1 s) has taken the last of the work."""
    seen: list[tuple[float, float]] = []  # (when, charge)

    def settled() -> bool:
        now, charge = time.monotonic(), _charged(broker)
        if not seen or seen[-1][1] != charge:
            seen.append((now, charge))
        # unchanged for longer than the accounting period
        return charge > before and now - seen[-1][0] > 1.5
    wait_for(settled, 20, "the accounting fence to charge mallory's work")
    return seen[-1][1] - before


def _rounds(gpu: RemoteGpu, make: Callable[[int], TorchOp]) -> None:
    for i in range(ROUNDS):
        op = make(i)
        gpu.torch_op(op)
        gpu.torch_free([h for h in op.outs if h is not None])
    gpu.synchronize()


def test_relayout_copies_are_charged(broker: BrokerProcess) -> None:
    with connect(broker.target, token=broker.tokens["mallory"], timeout=60) as gpu:
        assert isinstance(gpu, RemoteGpu)
        gpu.torch_op(TorchOp("aten::ones.default", [[1]], {}, ["one"], [("float32", (1,), (1,), 0)]))
        gpu.torch_op(TorchOp("aten::expand.default", [TensorArg("one"), [N]], {}, ["wide"],
                             [("float32", (N,), (0,), 0)]))
        gpu.synchronize()
        start = _charged(broker)
        _rounds(gpu, lambda i: TorchOp("aten::clone.default", [TensorArg("wide")],
                                       {"memory_format": MemoryFormatArg("contiguous_format")}, [f"c{i}"],
                                       [("float32", (N,), (1,), 0)]))
        timed = _settled(broker, start)
        start += timed
        # The attack: a view announced contiguous, materialized by _as_announced outside the timer.
        _rounds(gpu, lambda i: TorchOp("aten::alias.default", [TensorArg("wide")], {}, [f"a{i}"],
                                       [("float32", (N,), (1,), 0)]))
        try:
            untimed = _settled(broker, start)
        except AssertionError:  # (charged nothing at all)
            untimed = _charged(broker) - start
    print(f"\n{ROUNDS} materializations of 128 MiB: charged {timed:.3f} s as clone, {untimed:.4f} s as an alias "
          "announced contiguous")
    # (within 4x: a hold is charged at least its worker's own CPU now, which counts the clone's allocation of fresh
    # pages more than the alias's copy into them; before the fix the alias was charged ~400x less)
    assert untimed >= timed / 4, (f"the same work charged {untimed:.4f} s of device time where clone was charged "
                                  f"{timed:.3f} s: _as_announced's copies run outside the torch device's timer")
