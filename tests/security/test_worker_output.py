"""A kernel's writes to its worker's stdout and stderr cannot forge the broker's log, nor flood it (issue 21, item 5).

The attack, from inside mallory's worker on PoCL (the syscall interpreter of exploits.py): ``write(2, ...)`` of a
whole line that looks like one the front writes (an admin ending bob's session, in the log's own format, with a
newline before and after), a line holding a carriage return and a terminal escape, then 2 MiB of such forged lines
to fd 2 and 2 MiB more to fd 1. The log must hold no line that starts as a front line and that the front did not
write: what the kernel wrote appears only as an escaped field of a worker-output record tagged with mallory's
tenant. The log grows by far less than the 4 MiB written (the per-worker rate limit), one summary line says how
much was dropped, and the broker and bob keep working. Run once with text log lines and once with JSON lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import secrets
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from gpubroker.broker.front.workers import WorkerClient
from gpubroker.broker.front.workers._output import escape
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.broker.sandbox import Launch, WorkerSandbox
from gpubroker.client import Kernel, ModuleFormat, RemoteGpu, Unavailable, connect

from ..helpers import wait_for
from .exploits import ATTACK_SOURCE, VICTIM_SOURCE, Program, check_arch, run

TENANTS = [TenantSpec("mallory"), TenantSpec("bob")]
TIMEOUT = 60.0
# Per fd. The front reads a flooding pipe one pipe's worth (64 KiB) per pause of 0.1 s, so the flood's size sets
# this test's time (8 MiB a fd took 26 s); 4 MiB written still grows an unlimited log past the 1 MiB it is allowed
# four times over, while a limited one grows by its burst plus its rate (about 0.1 MiB).
FLOOD = 2 << 20
# A line of the text log as the front writes it: its timestamp, the logger, the level, the message.
TEXT_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) (\S+) (\S+) (.*)$")


@dataclass
class World:
    broker: BrokerProcess
    log_format: str
    attacker: RemoteGpu
    attack: Kernel
    victim: RemoteGpu
    scale: Kernel


@pytest.fixture(scope="module", params=["text", "json"])
def world(request: pytest.FixtureRequest) -> Iterator[World]:
    check_arch()
    with BrokerProcess(TENANTS, backend="opencl", settings={"log_format": request.param,
                                                                  "metrics_listen": "127.0.0.1:0"}) as broker, \
            contextlib.ExitStack() as stack:
        attacker = stack.enter_context(connect(broker.target, token=broker.tokens["mallory"], timeout=TIMEOUT))
        attack = attacker.get_kernel(attacker.load_module(ATTACK_SOURCE, ModuleFormat.OPENCL_C), "gpb_attack")
        victim = stack.enter_context(connect(broker.target, token=broker.tokens["bob"], timeout=TIMEOUT))
        scale = victim.get_kernel(victim.load_module(VICTIM_SOURCE, ModuleFormat.OPENCL_C), "gpb_scale")
        yield World(broker, request.param, attacker, attack, victim, scale)


def _forged(log_format: str, nonce: str, what: str) -> bytes:
    """A line as the front would write it: bob's session ended by an admin (``what`` tells the copies apart)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S") + ",123"
    if log_format == "json":
        return json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S.123Z", time.gmtime()), "level": "INFO",
                           "logger": "gpubroker.audit", "message": f"admin=ops action=end-session {what} {nonce}",
                           "tenant": "bob"}).encode()
    return f"{stamp} gpubroker.audit INFO admin=ops action=end-session session=ses_{what} {nonce} tenant=bob".encode()


def _serves(gpu: RemoteGpu, kernel: Kernel) -> None:
    x = np.arange(1024, dtype=np.float32)
    buf = gpu.allocate_memory(x.nbytes)
    gpu.copy_h2d(x, buf)
    gpu.execute_kernel(kernel, 4, 256, [buf, np.float32(3), np.int32(x.size)])
    gpu.synchronize()
    out = np.empty_like(x)
    gpu.copy_d2h(buf, out)
    gpu.free_memory(buf)
    np.testing.assert_array_equal(out, x * 3 + 1)


def _records(world: World, text: str) -> list[tuple[str, dict[str, str]]]:
    """Each log line as (the line, its fields): the logger, level, tenant and the worker's output where there is
    one. A line that is neither the front's text format nor a JSON object is returned with no fields."""
    records: list[tuple[str, dict[str, str]]] = []
    for line in text.split("\n"):
        if not line:
            continue
        if world.log_format == "json":
            try:
                record = json.loads(line)
            except ValueError:
                records.append((line, {}))
                continue
            records.append((line, {k: str(v) for k, v in record.items()} if isinstance(record, dict) else {}))
            continue
        found = TEXT_LINE.match(line)
        if found is None:
            records.append((line, {}))
            continue
        fields = {"logger": found.group(2), "level": found.group(3), "message": found.group(4)}
        tenant = re.match(r"tenant=(\S+) ", found.group(4))
        if tenant:
            fields["tenant"] = tenant.group(1)
        records.append((line, fields))
    return records


def _forgery(line: str, fields: dict[str, str], nonce: str) -> bool:
    """A line holding the kernel's text that is not a worker-output record of mallory's with the text in its
    ``output`` field only (in text lines: after the front's prefix, inside ``output="..."``)."""
    if nonce not in line:
        return False
    if fields.get("logger") != "gpubroker.worker.output" or fields.get("tenant") != "mallory":
        return True
    if "output" in fields:  # JSON: the kernel's text in its own field, nowhere else
        return nonce in fields.get("message", "") or nonce not in fields["output"]
    prefix = re.match(r'tenant=mallory device=\d+ pid=\d+ stream=std(out|err) output="', fields.get("message", ""))
    return prefix is None


def test_a_kernel_cannot_forge_or_flood_the_log(world: World) -> None:
    broker = world.broker
    nonce = f"forged-{secrets.token_hex(8)}"
    forged = _forged(world.log_format, nonce, "first")
    line = _forged(world.log_format, nonce, "flood") + b"\n"
    flood = line * (FLOOD // len(line) + 1)
    before = broker.log_path.stat().st_size

    program = Program()
    a = program.attempt("write forged lines and 2 MiB to fd 2 and fd 1", must_fail=False)
    first = program.put(b"\n" + forged + b"\n")
    tricks = program.put(b"overwrite\r\x1b[2K" + forged + b"\n")
    flood_at = program.put(flood[:FLOOD])
    program.call(a, "write", 2, first, len(forged) + 2)
    program.call(a, "write", 2, tricks, len(forged) + 15)
    program.call(a, "write", 2, flood_at, FLOOD)
    program.call(a, "write", 1, flood_at, FLOOD)
    (attempt,) = run(world.attacker, world.attack, program)
    print(f"\n{attempt}")
    assert attempt.results == [len(forged) + 2, len(forged) + 15, FLOOD, FLOOD], \
        "the kernel's writes did not all go through: the test proves nothing"

    def settled() -> bool:
        """The front said what it dropped, or a line the kernel wrote stands in the log as the front's."""
        records = _records(world, broker.log_path.read_bytes()[before:].decode(errors="replace"))
        return any(_forgery(line, fields, nonce) or (
            fields.get("logger") == "gpubroker.worker.output" and fields.get("tenant") == "mallory"
            and "dropped" in fields.get("message", "") and nonce not in line) for line, fields in records)

    wait_for(settled, TIMEOUT, "a summary line of mallory's dropped worker output")
    _serves(world.victim, world.scale)  # bob's work, after the flood
    again = Program()
    again.getpid("mallory's worker still serves her")
    (alive,) = run(world.attacker, world.attack, again)
    assert alive.ret > 0, alive
    assert broker.process is not None and broker.process.poll() is None, "the front died"

    raw = broker.log_path.read_bytes()[before:]
    grown = len(raw)
    print(f"the log grew by {grown} bytes for {2 * FLOOD + 2 * len(forged) + 17} written by the kernel")
    records = _records(world, raw.decode(errors="replace"))
    carrying = [(line, f) for line, f in records if nonce in line]
    assert carrying, "the kernel's first line is not in the log at all: the worker's output must stay readable"
    forged_lines = [line for line, fields in carrying if _forgery(line, fields, nonce)]
    assert not forged_lines, (f"{len(forged_lines)} lines the kernel wrote reached the log as the front's own, "
                              f"e.g.:\n{forged_lines[0][:400]}")
    assert grown < 1 << 20, f"the log grew by {grown} bytes: the worker's output was not rate-limited"
    assert b"\r" not in raw and b"\x1b" not in raw, "a control character the kernel wrote reached the log raw"
    # Readable: the kernel's first line is there as it wrote it, escaped only where it had to be.
    shown = [f.get("output", f.get("message", "")) for _, f in carrying]
    scrape = urllib.request.urlopen(broker.metrics_url, timeout=10).read().decode()
    dropped = re.search(r'^gpubroker_worker_output_dropped_bytes_total\{tenant="mallory"\} (\S+)$', scrape, re.M)
    assert dropped is not None and float(dropped.group(1)) > FLOOD, "the dropped bytes are not in the metrics"
    assert 'gpubroker_worker_output_dropped_bytes_total{tenant="bob"} 0.0' in scrape
    # (a text line's field is quoted, so its quotes are escaped; a JSON line's is quoted by JSON)
    expected = forged.decode() if world.log_format == "json" else forged.decode().replace('"', '\\"')
    assert any(expected in s for s in shown), shown[:3]
    assert any("overwrite\\r\\x1b[2K" in s for s in shown), shown[:3]


class _Unbuildable(WorkerSandbox):
    """The real launcher, told to join a cgroup that does not exist: it fails its set-up before any worker runs."""

    def prepare(self, tenant: str, device: int, worker_argv: list[str], keep_fds: list[int]) -> Launch:
        spec = self.spec(None, keep_fds, Path("/nonexistent-gpb-cgroup"))
        return Launch(self.launcher_argv(spec, worker_argv), self.environment(None))


def test_a_sandbox_that_cannot_be_built_is_explained(caplog: pytest.LogCaptureFixture) -> None:
    """The launcher's own message (on its stderr, exit status 125) still says why a worker could not start: in
    the start's error, and in the log as the worker's output."""
    client = WorkerClient("mallory", 0, "opencl", sandbox=_Unbuildable(enabled=True, backend="opencl"))
    with caplog.at_level(logging.INFO), pytest.raises(Unavailable) as info:
        asyncio.run(client.start(60.0))
    print(info.value)
    assert re.search(r"exited with status 125: gpubroker sandbox: cannot build the worker's sandbox: "
                     r"write '0' to /nonexistent-gpb-cgroup/cgroup\.procs", str(info.value)), info.value
    (record,) = [r for r in caplog.records if r.name == "gpubroker.worker.output"]
    assert record.getMessage().startswith("tenant=mallory device=0 pid=")
    assert "cannot build the worker's sandbox" in getattr(record, "output", "")


def test_escapes_leave_nothing_that_starts_a_line_or_ends_the_field() -> None:
    hostile = "a\nb\rc\x1b[2K\u2028d\u2029e\u202e\x85\"\\".encode() + b"\xff\xc3"
    text = escape(hostile.decode("utf-8", "surrogateescape"))
    assert text == 'a\\nb\\rc\\x1b[2K\\u2028d\\u2029e\\u202e\\u0085\\"\\\\\\xff\\xc3'
    assert text.isprintable() and len(text.splitlines()) == 1
    assert escape("fatal device error; exiting") == "fatal device error; exiting"  # an honest line reads as written
