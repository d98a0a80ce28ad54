"""The front's device-memory bounds, in parts: NVML's processes summed by worker (real process trees), each worker's
bound, a report past the quota, and the watch's thread handing a reading to the event loop.

NVML itself is only on the GPU machine (tests/security/test_device_memory_nvml_watch.py runs the whole watch there);
here a stand-in lists the processes NVML would.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from gpubroker.broker.front._memwatch import MemoryWatch, attribute, lineage, over_bound
from gpubroker.broker.front.workers import WorkerClient
from gpubroker.wire.errors import GpuBrokerError, ResourceExhausted
from tests.helpers import descendants, wait_for

MiB = 1 << 20
HEADROOM = 1024 * MiB


@pytest.fixture
def tree() -> Iterator[tuple[subprocess.Popen[bytes], list[int]]]:
    """A launcher stand-in (the front's child: this process's) with two children."""
    launcher = subprocess.Popen(["sh", "-c", "sleep 60 & sleep 60 & wait"])
    children: list[int] = []
    try:
        wait_for(lambda: len(descendants(launcher.pid)) == 2, 10, "the launcher's two children")
        children = descendants(launcher.pid)
        yield launcher, children
    finally:
        launcher.kill()
        launcher.wait()
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _worker(process: subprocess.Popen[bytes], quota: int | None = 64 * MiB) -> WorkerClient:
    worker = WorkerClient("alice", 0, "cuda")
    worker.process = process
    worker.quota_sent(quota)
    return worker


def test_nvml_processes_are_summed_by_the_worker_they_descend_from(
        tree: tuple[subprocess.Popen[bytes], list[int]]) -> None:
    launcher, (a, b) = tree
    front = os.getpid()
    processes = {a: {0: 100, 1: 7}, b: {0: 50}, launcher.pid: {0: 1}, front: {0: 5}, 1: {0: 999}}
    lines = lineage(processes, front)
    assert lines[a][-1] == lines[b][-1] == launcher.pid and front not in lines and 1 not in lines
    assert attribute(processes, lines, {launcher.pid}) == {launcher.pid: {0: 151, 1: 7}}
    # A launcher the workers' zygote forked is the front's grandchild: the nearest worker is found, not the zygote.
    assert attribute(processes, lines, {a, launcher.pid}) == {a: {0: 100, 1: 7}, launcher.pid: {0: 51}}
    assert attribute({a: {0: 100}}, lineage([a], launcher.pid), {a}) == {a: {0: 100}}  # (another front)
    assert lineage([a], 1 << 30) == {}  # nobody's: left out
    assert attribute(processes, lines, {1 << 30}) == {}  # no worker's: left out


def test_a_workers_bound_is_its_highest_quota_plus_the_headroom_on_its_device_and_the_headroom_elsewhere(
        tree: tuple[subprocess.Popen[bytes], list[int]]) -> None:
    worker = _worker(tree[0])
    worker.quota_sent(32 * MiB)  # a reload lowered it: what it already holds stays allowed
    worker.quota_sent(None)
    assert worker.memory_quota_max == 64 * MiB
    assert over_bound(worker, {0: 64 * MiB + HEADROOM}, HEADROOM) is None
    assert over_bound(worker, {0: 64 * MiB + HEADROOM + 1}, HEADROOM) == (0, 64 * MiB + HEADROOM + 1,
                                                                          64 * MiB + HEADROOM)
    assert over_bound(worker, {0: MiB, 1: HEADROOM}, HEADROOM) is None
    assert over_bound(worker, {0: MiB, 1: HEADROOM + 1}, HEADROOM) == (1, HEADROOM + 1, HEADROOM)
    assert over_bound(_worker(tree[0], None), {0: 1 << 40}, HEADROOM) is None  # no quota sent: no tenant code ran


def test_a_report_past_the_quota_kills_the_worker_at_once(tree: tuple[subprocess.Popen[bytes], list[int]]) -> None:
    launcher = tree[0]
    worker = _worker(launcher)
    seen: list[int] = []
    worker.on_memory = lambda _w, used: seen.append(used)
    worker.memory_reported(64 * MiB)
    assert seen == [64 * MiB] and launcher.poll() is None
    worker.memory_reported(64 * MiB + 1)
    assert seen == [64 * MiB]  # never mirrored
    assert launcher.wait(10) == -9
    assert isinstance(worker.fault, ResourceExhausted) and worker.memory_kill == "report"
    assert "reported 67108865 bytes of device memory in use, more than its quota" in worker.fault.message


def test_the_watch_kills_a_worker_past_its_bound_once_from_its_own_thread(
        tree: tuple[subprocess.Popen[bytes], list[int]], caplog: pytest.LogCaptureFixture) -> None:
    launcher, (a, _) = tree
    worker = _worker(launcher)
    held = {"bytes": 600 * MiB}
    nvml = SimpleNamespace(
        nvmlDeviceGetComputeRunningProcesses=lambda handle: [SimpleNamespace(pid=a, usedGpuMemory=held["bytes"]),
                                                             SimpleNamespace(pid=1, usedGpuMemory=1 << 40)],
        nvmlShutdown=lambda: None)
    kills: list[tuple[WorkerClient, GpuBrokerError]] = []
    pool = SimpleNamespace(workers=lambda: [worker])

    async def scenario() -> None:
        watch = MemoryWatch(nvml, {0: "handle"}, pool, HEADROOM,  # type: ignore[arg-type]
                            lambda w, f: kills.append((w, f)), period=0.01)
        watch.start()
        for _ in range(20):  # twenty readings within the bound: nothing happens
            await asyncio.sleep(0.01)
        assert not kills and launcher.poll() is None
        held["bytes"] = 64 * MiB + HEADROOM + 1
        async with asyncio.timeout(10):
            while not kills:
                await asyncio.sleep(0.01)
        await watch.stop()

    with caplog.at_level(logging.WARNING, logger="gpubroker.audit"):
        asyncio.run(scenario())
    assert len(kills) == 1 and kills[0][0] is worker and worker.memory_kill == "nvml"
    assert launcher.wait(10) == -9
    message = kills[0][1].message
    assert "held 1140850689 bytes of device 0's memory" in message and "device_memory_headroom" in message
    assert "action=kill-worker reason=device-memory tenant=alice" in caplog.text
