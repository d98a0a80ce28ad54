"""deploy/gpubroker.service and the udev rule: systemd-analyze accepts the unit, and it says what the broker needs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gpubroker.broker.config import load_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNIT = DEPLOY / "gpubroker.service"
UDEV_RULE = DEPLOY / "70-nvidia-uvm.rules"
EXAMPLE_CONFIG = DEPLOY / "gpubroker.example.toml"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections -> keys -> every value given (DeviceAllow= and the like repeat)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        assert sep and current is not None and not raw.endswith("\\"), f"line {number}: {raw!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def seconds(timespan: str) -> float:
    """A systemd time span such as 60s, 1min 30s or 90 (seconds)."""
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", timespan)
    assert parts, timespan
    return sum(float(n) * units[u] for n, u in parts)


@pytest.fixture(scope="module")
def service() -> dict[str, list[str]]:
    return parse_unit(UNIT.read_text())["Service"]


def verify(unit_text: str, directory: Path) -> str:
    """systemd-analyze verify's complaints about the unit (it exits 0 on most of them, so read what it says)."""
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: apt-get install systemd (Debian's base images have it)"
    gpubroker = Path(sys.executable).parent / "gpubroker"
    assert gpubroker.exists(), gpubroker
    # ExecStart must name an executable that exists here: the venv's, in place of /opt/gpubroker's.
    text, count = re.subn(r"^ExecStart=\S+/gpubroker ", f"ExecStart={gpubroker} ", unit_text, flags=re.M)
    assert count == 1
    path = directory / "gpubroker.service"
    path.write_text(text)
    proc = subprocess.run([analyze, "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SYSTEMD_LOG_LEVEL": "notice",
                               "SYSTEMD_LOG_COLOR": "0"})
    # Complaints about other units installed on this machine are not ours.
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if "gpubroker" in line]
    return "\n".join(ours) if ours or proc.returncode == 0 else proc.stdout + proc.stderr


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    assert verify(UNIT.read_text(), tmp_path) == ""


def test_systemd_analyze_verify_would_catch_a_mistake(tmp_path: Path) -> None:
    # The check above can fail: a misspelt setting and a bad value are reported.
    broken = UNIT.read_text().replace("Type=notify", "Type=notfy").replace("UMask=0007", "UMusk=0007")
    complaints = verify(broken, tmp_path)
    assert "notfy" in complaints and "UMusk" in complaints, complaints


def test_unit_runs_a_notifying_broker_with_a_watchdog(service: dict[str, list[str]]) -> None:
    assert service["Type"] == ["notify"]
    assert service["NotifyAccess"] == ["main"]  # the workers inherit $NOTIFY_SOCKET; only the broker may speak
    assert seconds(service["WatchdogSec"][0]) >= 10
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert service["ExecStart"][0].split()[1:] == ["serve", "--config", "/etc/gpubroker/gpubroker.toml"]
    assert service["KillMode"] == ["mixed"]  # SIGTERM to the broker only: it stops its own workers after draining


def test_unit_outlasts_the_drain(service: dict[str, list[str]]) -> None:
    grace = load_config(EXAMPLE_CONFIG).drain_grace_seconds
    assert seconds(service["TimeoutStopSec"][0]) >= grace + 15, "TimeoutStopSec must outlast drain_grace_seconds"


def test_unit_socket_is_where_the_example_config_listens(service: dict[str, list[str]]) -> None:
    cfg = load_config(EXAMPLE_CONFIG)
    sockets = [Path(a[len("unix:"):]) for a in cfg.listen if a.startswith("unix:")]
    assert sockets and all(s.parent == Path("/run") / service["RuntimeDirectory"][0] for s in sockets), sockets
    assert service["UMask"] == ["0007"]
    assert service["User"] == ["gpubroker"] and service["Group"] == ["gpubroker"]
    # The broker chowns the socket to socket_group, which only a member may do.
    assert cfg.socket_group in service.get("SupplementaryGroups", [""])[0].split()


def test_unit_hardening_leaves_the_gpus_reachable(service: dict[str, list[str]]) -> None:
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes",
                       "PrivateTmp": "yes", "DevicePolicy": "closed", "LimitMEMLOCK": "infinity"}.items():
        assert service.get(key) == [value], key
    assert "PrivateDevices" not in service, "PrivateDevices= hides /dev/nvidia*"
    assert "MemoryDenyWriteExecute" not in service, "CUDA, CuPy and PoCL map generated code executable"
    allowed = {entry.split()[0]: entry.split()[1] for entry in service["DeviceAllow"]}
    for device in ("char-nvidia-frontend", "char-nvidia-uvm", "/dev/nvidiactl", "/dev/nvidia-uvm",
                   "/dev/nvidia-uvm-tools"):
        assert allowed.get(device) == "rw", device
    # A writable place for the JIT caches under ProtectSystem=strict; one directory per tenant in it (the broker
    # makes them), so no cache path shared by all tenants' workers.
    assert service["CacheDirectory"] == ["gpubroker"]
    assert not any(key in e for e in service.get("Environment", []) for key in ("CUPY_CACHE_DIR", "CUDA_CACHE_PATH",
                                                                                 "XDG_CACHE_HOME", "POCL_CACHE_DIR"))


def test_unit_lets_the_broker_sandbox_its_workers(service: dict[str, list[str]]) -> None:
    allowed = set(service["RestrictNamespaces"][0].split())
    assert {"user", "pid", "mnt", "ipc", "net", "uts", "cgroup"} <= allowed, "the sandbox's namespaces are refused"
    # These mount over parts of /proc, and the kernel then refuses the worker's own /proc.
    for key in ("ProtectKernelTunables", "ProtectKernelLogs", "ProtectProc"):
        assert service.get(key, ["no"]) in (["no"], ["default"]), key
    assert service.get("ProtectControlGroups", ["no"]) == ["no"], "the broker makes its workers' cgroups"
    assert {"memory", "pids"} <= set(service["Delegate"][0].split())


def test_udev_rule_creates_the_uvm_nodes_when_the_driver_loads() -> None:
    rules = []
    for line in UDEV_RULE.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            pairs = re.findall(r'\s*([A-Z]+(?:\{[^}]*\})?)\s*(==|!=|\+=|=|:=)\s*"([^"]*)"\s*(?:,|$)', line)
            assert ",".join(f'{k}{op}"{v}"' for k, op, v in pairs) == re.sub(r",\s+", ",", line.strip()), line
            rules.append({(k, op): v for k, op, v in pairs})
    on_load = [r for r in rules if r.get(("ACTION", "==")) == "add" and r.get(("SUBSYSTEM", "==")) == "module"
               and r.get(("KERNEL", "==")) == "nvidia"]
    # -u loads nvidia_uvm; -c 0 makes /dev/nvidia-uvm (minor 0) and /dev/nvidia-uvm-tools (minor 1).
    assert any(r[("RUN", "+=")].split() == ["/usr/bin/nvidia-modprobe", "-u", "-c", "0"] for r in on_load), on_load
