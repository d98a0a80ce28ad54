"""The sandbox needs no privilege: a broker started as the systemd unit starts it still confines its workers.

The unit runs the broker as ``User=gpubroker`` with ``NoNewPrivileges=yes`` and no capabilities. This machine runs
no systemd, so the test starts the broker the way that amounts to: as an unprivileged uid (65534) under
``setpriv`` with no capability in any set (not even the bounding set) and no_new_privs. Where the Python runtime or
the checkout sits under a directory that uid cannot enter (``/root``, mode 0700, on CI), a private mount namespace
of the test's own overlays that directory with a tmpfs holding just those paths, bound back in. The workers must
still get their user, PID, mount and network namespaces, seccomp filter and dropped capabilities, and serve a tenant.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import gpubroker
from gpubroker.broker import samples
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import AdminClient, connect

from ..conftest import worker_pids
from ..helpers import descendants, proc_status

UID = 65534
SETPRIV, UNSHARE = shutil.which("setpriv"), shutil.which("unshare")

# Runs as root in a private mount namespace: hand the broker's directory and the cache to the unprivileged uid,
# make the runtime reachable for it, then drop to it for good. "$@" is the broker's command line.
WRAPPER = r"""set -eu
for arg in "$@"; do case "$arg" in */gpubroker.toml) workdir=$(dirname "$arg");; esac; done
chown -R {uid}:{uid} "$workdir" {cache}
mount --make-rprivate /
export HOME="$workdir" XDG_CACHE_HOME="$workdir/.cache"  # the unit: the service user's home, CacheDirectory=
if [ -n "{hidden}" ]; then
  keep="$workdir/.keep"; mkdir "$keep"; i=0
  for path in {paths}; do mkdir "$keep/$i"; mount --bind "$path" "$keep/$i"; i=$((i + 1)); done
  mount -t tmpfs -o mode=0755 tmpfs "{hidden}"; i=0
  for path in {paths}; do mkdir -p "$path"; mount --bind "$keep/$i" "$path"; i=$((i + 1)); done
fi
exec setpriv --reuid={uid} --regid={uid} --clear-groups --no-new-privs --inh-caps=-all --ambient-caps=-all \
  --bounding-set=-all -- "$@"
"""


def _needed_under_root() -> list[str]:
    """The runtime's and the checkout's directories that sit under /root (which uid 65534 cannot enter)."""
    roots = {Path(sys.base_prefix), Path(sys.prefix), Path(gpubroker.__file__).resolve().parents[2]}
    return sorted(str(p) for p in roots if Path("/root") in p.parents)


@pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None or UNSHARE is None,
                    reason="needs root (to hand the test's files to an unprivileged uid), setpriv and unshare")
def test_an_unprivileged_broker_without_capabilities_sandboxes_its_workers(tmp_path: Path) -> None:
    # (Not under tmp_path: pytest's base directory is closed to other users.)
    cache = Path(tempfile.mkdtemp(prefix="gpb-cache-", dir="/tmp"))
    try:
        _run_unprivileged(tmp_path, cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _run_unprivileged(tmp_path: Path, cache: Path) -> None:
    paths = _needed_under_root()
    script = tmp_path / "as-the-unit.sh"
    script.write_text(WRAPPER.format(uid=UID, cache=cache, hidden="/root" if paths else "",
                                     paths=" ".join(f'"{p}"' for p in paths)))
    wrapper = [str(UNSHARE), "--mount", "--", "sh", str(script)]
    tenants = [TenantSpec("alice"), TenantSpec("ops", admin=True)]
    with BrokerProcess(tenants, backend="opencl", wrapper=wrapper, settings={"cache_dir": str(cache)}) as broker:
        assert broker.process is not None
        (front,) = [p for p in [broker.process.pid, *descendants(broker.process.pid)]
                    if b"gpubroker.broker.cli" in _cmdline(p)]
        status = proc_status(front)
        assert status["Uid"].split()[0] == str(UID) and status["NoNewPrivs"] == "1"
        assert int(status["CapBnd"], 16) == 0 and int(status["CapEff"], 16) == 0
        with connect(broker.target, token=broker.tokens["alice"]) as gpu:
            buf = gpu.allocate_memory(64)
            gpu.copy_h2d(np.ones(16, dtype=np.float32), buf)
            kernel = gpu.compile_kernel(samples.source("opencl"), "scale_inplace")
            gpu.execute_kernel(kernel, 1, 16, [buf, np.float32(2), np.int32(16)])
            out = np.empty(16, dtype=np.float32)
            gpu.copy_d2h(buf, out)
            assert (out == 3).all()  # scale_inplace: x = x * factor + 1
        (worker,) = [p for p in descendants(front) if b"gpubroker.broker.worker" in _cmdline(p)
                     and b"alice" in _cmdline(p) and b"gpubroker.broker.sandbox" not in _cmdline(p)]
        status = proc_status(worker)
        assert status["Seccomp"] == "2" and int(status["CapEff"], 16) == 0
        for ns in ("user", "pid", "mnt", "net"):
            assert os.readlink(f"/proc/{worker}/ns/{ns}") != os.readlink(f"/proc/{front}/ns/{ns}"), ns
        with AdminClient(broker.target, broker.tokens["ops"]) as admin:
            assert admin.status().sandbox.startswith("namespaces+seccomp+")
        assert worker_pids(broker, "alice") == [worker]


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()
