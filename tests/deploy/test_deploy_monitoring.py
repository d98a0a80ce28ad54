"""deploy/'s monitoring: the DaemonSet's HTTP probes and metrics port, the optional PodMonitor and PrometheusRule
(deploy/kubernetes/monitoring/), the Grafana dashboard (deploy/grafana/): each parsed, and every metric and label
they name checked against a real broker's exposition (a typo in an alert would otherwise never fire)."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpubroker.broker.config import load_config
from gpubroker.broker.launcher import BrokerProcess, TenantSpec
from gpubroker.client import AdminClient, connect
from gpubroker.wire.addresses import parse_host_port
from tests.deploy.test_deploy_kubernetes import MANIFESTS, broker_container, documents, one

DEPLOY = MANIFESTS.parent
MONITORING = MANIFESTS / "monitoring"
DASHBOARD = DEPLOY / "grafana" / "gpubroker-dashboard.json"
# Labels Prometheus adds to every series it scrapes (job, instance) or the PodMonitor's relabeling adds (node).
TARGET_LABELS = {"job", "instance", "node", "le"}
_METRIC = re.compile(r"\b((?:gpubroker|process)_[a-z0-9_]+)\b(?:\{([^}]*)\})?")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")


@pytest.fixture(scope="module")
def broker(backend: str) -> Iterator[BrokerProcess]:
    settings = {"metrics_listen": "127.0.0.1:0", "drain_grace_seconds": 300.0}
    with BrokerProcess([TenantSpec("ops", admin=True), TenantSpec("alice")], backend=backend,
                       settings=settings) as proc:
        with connect(proc.target, token=proc.tokens["alice"]) as gpu:  # (an RPC: its histogram's series)
            gpu.allocate_memory(1 << 20)
        yield proc


def get(broker: BrokerProcess, path: str) -> tuple[int, bytes]:
    host, port = broker.metrics.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.fixture(scope="module")
def exposition(broker: BrokerProcess) -> dict[str, set[str]]:
    """Every sample name the broker serves, with the label names its samples carry."""
    status, body = get(broker, "/metrics")
    assert status == 200
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    return names


def check_expression(expr: str, exposition: dict[str, set[str]], where: str) -> int:
    """Every metric ``expr`` names is served, with every label it matches on; how many it names."""
    found = 0
    for match in _METRIC.finditer(expr):
        name, matchers = match.group(1), match.group(2) or ""
        assert name in exposition, f"{where}: {name} is not in the broker's exposition"
        for label in _MATCHER.findall(matchers):
            assert label in exposition[name] | TARGET_LABELS, f"{where}: {name} has no label {label!r}"
        found += 1
    return found


def test_the_daemonset_probes_and_exposes_the_metrics_listener() -> None:
    container = broker_container(one("DaemonSet"))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    secret = next(d for d in documents("secret.example.yaml") if d["metadata"]["name"] == "gpubroker-config")
    listen = re.search(r'^\s*metrics_listen\s*=\s*"([^"]+)"', secret["stringData"]["gpubroker.toml"], re.M)
    assert listen is not None, "the example config must set metrics_listen: the probes use it"
    assert parse_host_port(listen.group(1)).port == ports["metrics"]
    paths = {probe: container[probe]["httpGet"]["path"] for probe in ("startupProbe", "readinessProbe",
                                                                       "livenessProbe")}
    assert paths == {"startupProbe": "/livez", "readinessProbe": "/readyz", "livenessProbe": "/livez"}
    assert {container[p]["httpGet"]["port"] for p in paths} == {"metrics"}


def test_the_example_config_with_metrics_loads(tmp_path: Path) -> None:
    secret = next(d for d in documents("secret.example.yaml") if d["metadata"]["name"] == "gpubroker-config")
    path = tmp_path / "gpubroker.toml"
    path.write_text(secret["stringData"]["gpubroker.toml"])
    assert load_config(path).metrics_listen == "0.0.0.0:9464"


def test_the_daemonsets_probes_against_a_real_broker_follow_a_drain(broker: BrokerProcess) -> None:
    container = broker_container(one("DaemonSet"))
    probes = {p: container[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {p: get(broker, path)[0] for p, path in probes.items()} == dict.fromkeys(probes, 200)
    with AdminClient(broker.target, broker.tokens["ops"]) as admin:
        admin.drain(300)
        try:
            # Unready (out of the Service's endpoints), but alive: the kubelet does not restart a draining broker.
            assert {p: get(broker, path)[0] for p, path in probes.items()} == {
                "startupProbe": 200, "readinessProbe": 503, "livenessProbe": 200}
        finally:
            admin.undrain()
    assert get(broker, probes["readinessProbe"])[0] == 200


def test_the_podmonitor_is_optional_and_scrapes_the_metrics_port() -> None:
    default = documents("kustomization.yaml")[0]["resources"]
    assert not any("monitoring" in r for r in default), "the CRD-dependent resources must stay optional"
    assert set(yaml.safe_load((MONITORING / "kustomization.yaml").read_text())["resources"]) == {
        p.name for p in MONITORING.glob("*.yaml")} - {"kustomization.yaml"}
    (monitor,) = yaml.safe_load_all((MONITORING / "podmonitor.yaml").read_text())
    assert (monitor["apiVersion"], monitor["kind"]) == ("monitoring.coreos.com/v1", "PodMonitor")
    daemonset = one("DaemonSet")
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [daemonset["metadata"]["namespace"]]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in {p["name"] for p in broker_container(daemonset)["ports"]}
    assert endpoint["path"] == "/metrics"
    # job="gpubroker", as the rules and the dashboard select.
    assert pod_labels[monitor["spec"]["jobLabel"]] == "gpubroker"


def rules() -> list[dict[str, Any]]:
    (rule,) = yaml.safe_load_all((MONITORING / "prometheusrule.yaml").read_text())
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def test_the_alert_rules_name_only_served_metrics(exposition: dict[str, set[str]]) -> None:
    found = rules()
    alerts = {r["alert"] for r in found}
    assert {"GpubrokerDown", "GpubrokerDeviceUnhealthy", "GpubrokerQuotaExhaustion", "GpubrokerSchedulerWaitHigh",
            "GpubrokerWorkerKills"} <= alerts
    for rule in found:
        assert rule["labels"]["severity"] in ("critical", "warning", "info") and rule["annotations"]["summary"]
        named = check_expression(rule["expr"], exposition, rule["alert"])
        assert named or 'up{job="gpubroker"}' in rule["expr"], f"{rule['alert']} names no gpubroker metric"


# Where a promtool unpacked from Debian's prometheus package is kept between runs (not installed: nothing of the
# machine's changes; CI's Debian has the package, about 19 MB).
PROMTOOL_CACHE = Path(__file__).resolve().parents[2] / ".venv" / "promtool"


def _promtool() -> str | None:
    """promtool: on the PATH, else unpacked from Debian's prometheus package (apt-get download, dpkg-deb -x), else
    None (not a Debian machine, or no package archive reachable)."""
    found = shutil.which("promtool")
    unpacked = PROMTOOL_CACHE / "usr" / "bin" / "promtool"
    if found or unpacked.exists():
        return found or str(unpacked)
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        return None
    PROMTOOL_CACHE.mkdir(parents=True, exist_ok=True)
    got = subprocess.run(["apt-get", "download", "prometheus"], cwd=PROMTOOL_CACHE, capture_output=True, timeout=300)
    debs = sorted(PROMTOOL_CACHE.glob("prometheus_*.deb"))
    if got.returncode != 0 or not debs:
        return None
    subprocess.run(["dpkg-deb", "-x", str(debs[-1]), str(PROMTOOL_CACHE)], check=True, timeout=120)
    for deb in debs:
        deb.unlink()
    return str(unpacked) if unpacked.exists() else None


def test_promtool_checks_the_alert_rules(tmp_path: Path) -> None:
    promtool = _promtool()
    if promtool is None:
        pytest.skip("promtool is neither installed nor unpackable from Debian's prometheus package here")
    (rule,) = yaml.safe_load_all((MONITORING / "prometheusrule.yaml").read_text())
    path = tmp_path / "gpubroker.rules.yml"
    path.write_text(yaml.safe_dump(rule["spec"]))
    result = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def test_the_dashboard_names_only_served_metrics(exposition: dict[str, set[str]]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    named = 0
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        for target in panel["targets"]:
            named += check_expression(target["expr"], exposition, f"panel {panel['title']!r}")
    for name in ("node", "tenant"):
        named += check_expression(variables[name]["definition"], exposition, f"variable {name}")
    # Every family an operator watches has a panel.
    for family in ("gpubroker_scheduler_wait_seconds_bucket", "gpubroker_device_healthy",
                   "gpubroker_kernel_launches_total", "gpubroker_copied_bytes_total", "gpubroker_auth_failures_total",
                   "gpubroker_sessions_opened_total", "gpubroker_device_memory_used_bytes"):
        assert family in DASHBOARD.read_text(), f"no panel shows {family}"
    assert named > 20
