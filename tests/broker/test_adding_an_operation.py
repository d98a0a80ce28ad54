"""Adding an operation takes the four places docs/architecture/adding-an-operation.md names, and nothing else.

``tests/broker/added_operation.py`` adds ``checksum`` that way from outside the tree (a command class with its
traits, a handler, a backend method, the SDK's method), with no line of gpubroker changed. Then it runs: in-process
on the backend; through the one executor, which takes its handler from the registration; and end to end through a
real broker, whose front and workers import it at start (a ``sitecustomize`` on PYTHONPATH, as a plugin would be
found), on every transport: the front decodes it from the Commands stream, schedules it as the device work its
class says it is, and holds the worker's answer to the result type its class declares.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpubroker.broker.backends import open_backend
from gpubroker.broker.config import TlsConfig
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.broker.worker._executor import Executor
from gpubroker.broker.worker._handles import HandleTables
from gpubroker.broker.worker._segments import SegmentTable
from gpubroker.client import OutOfRange, RemoteGpu, TlsOptions, connect
from gpubroker.wire.commands import Allocate, Batch, Write, commands, decode_batch, encode, link_commands, new_handle
from tests.broker.added_operation import Checksum
from tests.conftest import TRANSPORTS

ROOT = Path(__file__).resolve().parents[2]
DATA = (np.arange(1000) * 7 % 256).astype(np.uint8)


def test_defining_the_command_registers_it_with_its_traits() -> None:
    assert Checksum in commands() and Checksum in link_commands()
    assert Checksum.device_work and not Checksum.host_work
    batch = Batch(1, 0, [Checksum(("b1", 0), 16)])
    assert decode_batch(encode(batch)) == batch  # every decoder takes it


def test_the_backend_and_the_executor_run_it() -> None:
    backend = open_backend("opencl", 0)
    try:
        buf = backend.allocate_memory(DATA.nbytes)
        backend.copy_h2d(DATA, buf)
        assert backend.checksum(buf, DATA.nbytes) == int(DATA.sum())  # type: ignore[attr-defined]
        executor = Executor(backend, HandleTables(), SegmentTable(backend))
        assert Checksum in executor.handlers and Checksum in executor.link_handlers
        handle = new_handle("buf")
        ack = executor.run("s", Batch(1, 0, [Allocate(handle, 64), Write((handle, 0), 0, DATA[:64].tobytes()),
                                             Checksum((handle, 0), 64)]))
        assert ack.error is None and ack.result == int(DATA[:64].sum())
        ack = executor.run("s", Batch(2, 3, [Checksum((handle, 0), 65)]))
        assert ack.error is not None and (ack.error.seq, ack.error.command) == (3, "checksum of 65 bytes")
        assert ack.error.code == "OUT_OF_RANGE"
    finally:
        backend.close()


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory,
           server_tls: tuple[TlsConfig, TlsOptions]) -> Iterator[BrokerProcess]:
    """A broker whose front and workers import the operation at start (unsandboxed: the sandbox's root does not
    hold this checkout's tests)."""
    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text("import tests.broker.added_operation  # noqa: F401\n")
    settings = {"tls": server_tls[0], "link_listen": "127.0.0.1:0", "sandbox": False,
                "cache_dir": str(tmp_path_factory.mktemp("caches"))}
    env = {"PYTHONPATH": f"{site}:{ROOT}"}
    with BrokerProcess([TenantSpec("adder")], backend="opencl", tcp=["127.0.0.1:0"], settings=settings,
                       env=env) as proc:
        yield proc


def _open(broker: BrokerProcess, tls: TlsOptions, transport: str, **kwargs: Any) -> RemoteGpu:
    if transport == "tcp-tls":
        return connect(broker.tcp_target, token=broker.tokens["adder"], tls=tls, transport="link", **kwargs)
    return connect(broker.target, token=broker.tokens["adder"], transport=transport, **kwargs)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_it_runs_end_to_end_on_every_transport(broker: BrokerProcess, server_tls: tuple[TlsConfig, TlsOptions],
                                               transport: str) -> None:
    with contextlib.closing(_open(broker, server_tls[1], transport)) as gpu:
        buf = gpu.allocate_memory(DATA.nbytes)
        gpu.copy_h2d(DATA, buf)
        assert gpu.checksum(buf, DATA.nbytes) == int(DATA.sum())  # type: ignore[attr-defined]
        assert gpu.checksum(buf.at(999), 1) == int(DATA[999])  # type: ignore[attr-defined]
        # A failure names the command as its class describes it, and the session goes on.
        with pytest.raises(OutOfRange) as info:
            gpu.checksum(buf.at(1), DATA.nbytes)  # type: ignore[attr-defined]
        assert info.value.details["command"] == f"checksum of {DATA.nbytes} bytes"
        assert gpu.checksum(buf, 10) == int(DATA[:10].sum())  # type: ignore[attr-defined]
    assert "Traceback" not in broker.log_path.read_text(errors="replace")
