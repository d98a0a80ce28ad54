"""Start a broker in a child process on a temp Unix socket: for the demo, the benchmark and tests."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, cast

from gpubroker.broker.config import BrokerConfig, TenantConfig, save_config
from gpubroker.broker.front.auth import mint_token
from gpubroker.client import Unavailable
from gpubroker.wire.addresses import unix_path

BackendName = Literal["auto", "cuda", "opencl"]  # BrokerConfig.backend's values

__all__ = ["BrokerProcess", "TenantSpec", "descendants", "parent_pids"]


@dataclass
class TenantSpec:
    name: str
    memory_quota: int = 2 * 1024**3
    weight: int = 1
    admin: bool = False
    device_memory: dict[int, int] = field(default_factory=dict)  # per-device quotas besides memory_quota
    shared_memory: int | None = None  # [tenants.NAME] shared_memory (None: its memory_quota)


@dataclass
class BrokerProcess:
    """A real `gpubroker serve` process; ``tokens`` maps tenant names to their bearer tokens."""

    tenants: list[TenantSpec]
    backend: str = "auto"
    settings: dict[str, object] = field(default_factory=dict)
    tcp: list[str] = field(default_factory=list)  # TCP listeners besides the socket, e.g. "127.0.0.1:0"
    start_timeout: float = 120.0
    env: dict[str, str] = field(default_factory=dict)  # merged into the child's environment
    # A command the broker runs under (e.g. ``setpriv --no-new-privs ... --``, as a service manager would).
    wrapper: list[str] = field(default_factory=list)
    tokens: dict[str, str] = field(default_factory=dict)
    workdir: Path | None = None
    process: subprocess.Popen[bytes] | None = None
    ports: list[str] = field(default_factory=list)  # the bound addresses, from the ready file
    metrics: str = ""  # the metrics endpoint's bound host:port, from the ready file (with metrics_listen set)
    link_port: int = 0  # the TCP link's bound port (with link_listen set), from the ready file

    @property
    def tcp_target(self) -> str:
        """The first TCP listener's bound ``host:port`` (a port of 0 in ``tcp`` is resolved)."""
        return next(p for p in self.ports if unix_path(p) is None)

    @property
    def metrics_url(self) -> str:
        """``http://HOST:PORT/metrics`` of a broker started with ``settings={"metrics_listen": ...}``."""
        if not self.metrics:
            raise ValueError("this broker serves no metrics: start it with settings={'metrics_listen': '127.0.0.1:0'}")
        return f"http://{self.metrics}/metrics"

    @property
    def target(self) -> str:
        assert self.workdir is not None
        return f"unix:{self.workdir / 'broker.sock'}"

    @property
    def config_path(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "gpubroker.toml"

    @property
    def log_path(self) -> Path:
        assert self.workdir is not None
        return self.workdir / "broker.log"

    def start(self) -> BrokerProcess:
        # Unix socket paths are limited to ~107 bytes: keep the directory short.
        self.workdir = Path(tempfile.mkdtemp(prefix="gpb-", dir="/tmp"))
        # No drain grace unless asked for: stop() then ends whatever sessions are left at once, as a test, the demo
        # or a benchmark wants (a drain would wait for clients that were killed or leaked their sessions).
        # (a Struct's constructor does not validate: the broker checks the backend when it reads this config)
        cfg = BrokerConfig(listen=[self.target, *self.tcp], backend=cast(BackendName, self.backend),
                           drain_grace_seconds=0.0)
        for key, value in self.settings.items():
            setattr(cfg, key, value)
        for spec in self.tenants:
            token = mint_token()
            cfg.add_tenant(TenantConfig(spec.name, token.token_id, token.token_hash, spec.memory_quota, spec.weight,
                                        spec.admin, dict(spec.device_memory), spec.shared_memory))
            self.tokens[spec.name] = token.token
        config_path = save_config(cfg, self.workdir / "gpubroker.toml")
        ready = self.workdir / "ready.json"
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child owns it for its lifetime
        self.process = subprocess.Popen(
            [*self.wrapper, sys.executable, "-m", "gpubroker.broker.cli", "serve", "--config", str(config_path),
             "--ready-file", str(ready)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            env={**os.environ, **self.env})
        log.close()
        deadline = time.monotonic() + self.start_timeout
        # The broker writes the ready file only after its server has started; poll for it with a deadline.
        while not ready.exists():
            if self.process.poll() is not None:
                raise Unavailable(f"broker exited with {self.process.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise Unavailable(f"broker did not start within {self.start_timeout} s:\n{self.log_tail()}")
            time.sleep(0.02)
        announced = json.loads(ready.read_text())
        self.ports = list(announced["ports"])
        self.metrics = str(announced.get("metrics", ""))
        self.link_port = int(announced.get("link_port", 0))
        return self

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, wait, then SIGKILL the broker's process group. Its workers are sessions of their own (setsid);
        they die with it all the same (each launcher and worker has a parent-death signal)."""
        code = None
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                code = self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            code = self.process.wait()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return code

    def __enter__(self) -> BrokerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def parent_pids() -> dict[int, int]:
    """Every live process's parent, from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return parents


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (a sandbox puts its launcher between the broker and each worker)."""
    children: dict[int, list[int]] = {}
    for child, parent in parent_pids().items():
        children.setdefault(parent, []).append(child)
    found, todo = [], list(children.get(pid, []))
    while todo:
        below = todo.pop()
        found.append(below)
        todo.extend(children.get(below, []))
    return found
