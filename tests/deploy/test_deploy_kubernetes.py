"""deploy/kubernetes/: valid against Kubernetes' schemas (bundled, offline), consistent, and its probes work."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gpubroker.broker.config import load_config
from gpubroker.broker.launcher import BrokerProcess, TenantSpec

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUBERNETES = kubernetes_validate.latest_version()


def documents(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d is not None]


def resources() -> list[tuple[str, dict[str, Any]]]:
    return [(p.name, d) for p in sorted(MANIFESTS.glob("*.yaml")) if p.name != "kustomization.yaml"
            for d in documents(p.name)]


def one(kind: str) -> dict[str, Any]:
    found = [d for _, d in resources() if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}s"
    return found[0]


def broker_container(daemonset: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "gpubroker")


@pytest.fixture(scope="module")
def example_config(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The broker config inside the example Secret, loaded as the broker would load it."""
    secret = next(d for _, d in resources() if d["kind"] == "Secret" and d["metadata"]["name"] == "gpubroker-config")
    path = tmp_path_factory.mktemp("k8s") / "gpubroker.toml"
    path.write_text(secret["stringData"]["gpubroker.toml"])
    return load_config(path)


@pytest.mark.parametrize(("name", "doc"), [pytest.param(n, d, id=f"{n}:{d['kind']}/{d['metadata']['name']}")
                                           for n, d in resources()])
def test_manifest_is_valid_against_the_kubernetes_schema(name: str, doc: dict[str, Any]) -> None:
    # strict: an unknown (misspelt) field is an error, not silently dropped as the API server would.
    kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_schema_validation_would_catch_a_mistake() -> None:
    daemonset = one("DaemonSet")
    broker_container(daemonset)["livenessProb"] = broker_container(daemonset).pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="livenessProb"):
        kubernetes_validate.validate(daemonset, KUBERNETES, strict=True)


def test_kustomization_lists_every_manifest_but_the_example_secret() -> None:
    kustomization = documents("kustomization.yaml")[0]
    assert kustomization["kind"] == "Kustomization"
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk - {"secret.example.yaml"}, "placeholder Secrets must never be applied"
    images = {i["name"] for i in kustomization["images"]}
    spec = one("DaemonSet")["spec"]["template"]["spec"]
    assert {c["image"] for c in spec["containers"] + spec.get("initContainers", [])} <= images
    assert {d["metadata"].get("namespace") for _, d in resources() if d["kind"] != "Namespace"} == {
        kustomization["namespace"]}


def test_daemonset_serves_the_node_socket_and_the_tls_port(example_config: Any) -> None:
    daemonset, service = one("DaemonSet"), one("Service")
    spec = daemonset["spec"]["template"]["spec"]
    container = broker_container(daemonset)
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    # The socket directory is the node's, where pods of the node mount it too.
    sockets = [Path(a[len("unix:"):]) for a in example_config.listen if a.startswith("unix:")]
    assert len(sockets) == 1
    socket_volume = next(n for n, p in mounts.items() if Path(p) == sockets[0].parent)
    assert volumes[socket_volume]["hostPath"]["path"] == str(sockets[0].parent)
    # The TCP listener is the container port the Service sends to, and it is mTLS.
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    tcp = [a for a in example_config.listen if not a.startswith("unix:")]
    assert [int(a.rsplit(":", 1)[1]) for a in tcp] == [ports[service["spec"]["ports"][0]["targetPort"]]]
    assert example_config.tls is not None and example_config.tls.require_client_cert
    # The config and the TLS files are where the Secrets are mounted.
    config_path = Path(container["command"][container["command"].index("--config") + 1])
    assert volumes[next(n for n, p in mounts.items() if Path(p) == config_path.parent)]["secret"][
        "secretName"] == "gpubroker-config"
    tls_files = [Path(getattr(example_config.tls, k)) for k in ("cert_file", "key_file", "client_ca_file")]
    tls_volume = next(n for n, p in mounts.items() if Path(p) == tls_files[0].parent)
    assert volumes[tls_volume]["secret"]["secretName"] == "gpubroker-tls"
    tls_secret = next(d for _, d in resources() if d["kind"] == "Secret" and d["metadata"]["name"] == "gpubroker-tls")
    assert {f.name for f in tls_files} <= set(tls_secret["stringData"]), "the example Secret lacks a TLS file"


def test_daemonset_is_unprivileged_and_outlasts_the_drain(example_config: Any) -> None:
    daemonset = one("DaemonSet")
    spec = daemonset["spec"]["template"]["spec"]
    container = broker_container(daemonset)
    assert spec["terminationGracePeriodSeconds"] > example_config.drain_grace_seconds
    assert spec["securityContext"]["runAsNonRoot"] is True and not spec.get("hostNetwork")
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert not container["securityContext"].get("privileged")
    # The GPUs come from the device plugin: all of a node's, on nodes with that many.
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert spec["nodeSelector"]["nvidia.com/gpu.count"] == gpus
    # The worker sandbox: its own /proc needs the container's unmasked, which needs a pod user namespace.
    assert spec["hostUsers"] is False and container["securityContext"]["procMount"] == "Unmasked"
    for init in spec.get("initContainers", []):
        assert not init["securityContext"].get("privileged")
        assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}


def probe_command(probe: str, target: str) -> list[str]:
    """The exec probe daemonset.yaml names for a broker without metrics_listen (its probes are HTTP GETs on the
    metrics port: tests/deploy/test_deploy_monitoring.py), run here: this Python, and ``target`` for the socket."""
    assert "gpubroker.broker.healthcheck" in (MANIFESTS / "daemonset.yaml").read_text()
    live = ["--live"] if probe != "readinessProbe" else []
    return [sys.executable, "-m", "gpubroker.broker.healthcheck", *live, "--target", target]


def run_probe(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=30)


def test_probes_pass_against_a_serving_broker() -> None:
    with BrokerProcess([TenantSpec("alice")], backend="opencl") as broker:
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            result = run_probe(probe_command(probe, broker.target))
            assert result.returncode == 0, f"{probe}: {shlex.join(result.args)}\n{result.stdout}{result.stderr}"
            assert result.stdout.strip().endswith(": SERVING"), result.stdout


def test_probes_fail_without_a_broker(tmp_path: Path) -> None:
    for probe in ("readinessProbe", "livenessProbe"):
        result = run_probe([*probe_command(probe, f"unix:{tmp_path / 'none.sock'}"), "--timeout", "2"])
        assert result.returncode == 1, f"{probe}: {result.stdout}{result.stderr}"
        assert "UNAVAILABLE" in result.stdout
