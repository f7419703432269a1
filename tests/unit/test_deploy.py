"""The container image and the Kubernetes manifests, checked offline (no Docker engine or cluster here)."""

from __future__ import annotations

import json
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from exhook_server import metrics
from exhook_server.config import Config
from tests.harness import BIN, ROOT

K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSIONS = ["1.30.0", "1.37.0"]


def resources(kustomization: Path) -> list[dict[str, Any]]:
    """Every document of every file a kustomization lists (directories are other kustomizations)."""
    spec = yaml.safe_load(kustomization.read_text())
    docs: list[dict[str, Any]] = []
    for entry in spec["resources"]:
        path = (kustomization.parent / entry).resolve()
        if path.is_dir():
            docs += resources(path / "kustomization.yaml")
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> dict[str, Any]:
    [doc] = [d for d in resources(K8S / "kustomization.yaml") if d["kind"] == kind]
    return doc


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate_strictly(version: str) -> None:
    """Every core manifest validates against the Kubernetes schemas, unknown fields rejected."""
    docs = resources(K8S / "kustomization.yaml")
    assert {d["kind"] for d in docs} == {
        "Namespace",
        "ConfigMap",
        "Service",
        "StatefulSet",
        "PodDisruptionBudget",
        "NetworkPolicy",
    }
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_validation_catches_a_typo() -> None:
    """The schema check is real: a misspelt field fails it."""
    sts = by_kind("StatefulSet")
    sts["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, KUBERNETES_VERSIONS[-1], strict=True)


def test_configmap_is_a_valid_server_config() -> None:
    """The config.toml in the ConfigMap loads with the server's own loader."""
    text = by_kind("ConfigMap")["data"]["config.toml"]
    cfg = Config(**tomllib.loads(text))
    assert cfg.shutdown_timeout_s < by_kind("StatefulSet")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert cfg.data_dir.startswith("/var/lib/sdv-fanout")


def test_pod_runs_non_root_read_only_with_grpc_probes() -> None:
    """securityContext, probes and ports match what the server serves."""
    pod = by_kind("StatefulSet")["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] and c["securityContext"]["readOnlyRootFilesystem"]
    assert {p["containerPort"] for p in c["ports"]} == {
        Config().host_port[1],
        int(Config().metrics_listen.split(":")[1]),
    }
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == Config().host_port[1]


def test_network_policy_lets_only_emqx_reach_exhook_and_monitoring_reach_metrics() -> None:
    """Ingress to the pod: ExHook from EMQX's pods (by label and namespace), metrics from monitoring, nothing else."""
    policy = by_kind("NetworkPolicy")["spec"]
    pod_labels = by_kind("StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    exhook, metrics_port = Config().host_port[1], int(Config().metrics_listen.split(":")[1])
    allowed: dict[int, list[dict[str, Any]]] = {}
    for rule in policy["ingress"]:
        assert rule.get("from"), "a rule without `from` admits every source"
        for port in rule["ports"]:
            assert port["protocol"] == "TCP"
            allowed.setdefault(port["port"], []).extend(rule["from"])
    assert set(allowed) == {exhook, metrics_port}
    [emqx] = allowed[exhook]
    assert emqx["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "emqx"}
    assert emqx["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "emqx"}
    [monitoring] = allowed[metrics_port]
    assert monitoring == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def test_admin_api_stays_inside_the_pod() -> None:
    """admin_listen is loopback in the ConfigMap, and no container, Service or policy port exposes it."""
    cfg = Config(**tomllib.loads(by_kind("ConfigMap")["data"]["config.toml"]))
    host, admin_port = cfg.admin_listen.rsplit(":", 1)
    assert host == "127.0.0.1"
    [container] = by_kind("StatefulSet")["spec"]["template"]["spec"]["containers"]
    exposed = {p["containerPort"] for p in container["ports"]}
    exposed |= {
        p[k]
        for d in resources(K8S / "kustomization.yaml")
        if d["kind"] == "Service"
        for p in d["spec"]["ports"]
        for k in ("port", "targetPort")
        if isinstance(p[k], int)
    }
    exposed |= {p["port"] for r in by_kind("NetworkPolicy")["spec"]["ingress"] for p in r["ports"]}
    assert int(admin_port) not in exposed
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SDV_FANOUT_CONFIG"] == "/etc/sdv-fanout/config.toml"  # `kubectl exec ... stats --server` finds it


def test_service_monitor_scrapes_the_metrics_port() -> None:
    """The optional ServiceMonitor points at the Service's metrics port."""
    docs = resources(K8S / "monitoring" / "kustomization.yaml")
    [sm] = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    service_ports = {p["name"] for d in docs if d["kind"] == "Service" for p in d["spec"]["ports"]}
    assert sm["spec"]["endpoints"][0]["port"] in service_ports


def test_dockerfile_lints_clean_and_runs_the_server() -> None:
    """hadolint finds nothing; the image's entrypoint command works in the venv."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    lint = subprocess.run([str(BIN / "hadolint"), "-"], input=dockerfile, capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert 'ENTRYPOINT ["sdv-fanout", "serve"]' in dockerfile and re.search(r"^USER 10001", dockerfile, re.M)
    out = subprocess.run([str(BIN / "sdv-fanout"), "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--listen" in out.stdout


def dashboard_panels() -> list[dict[str, Any]]:
    """Every panel of the Grafana dashboard, those inside a collapsed row included (rows too)."""
    dash = json.loads((ROOT / "deploy" / "grafana" / "sdv-fanout.json").read_text())
    return [q for p in dash["panels"] for q in (p, *p.get("panels", []))]


def queried(panel: dict[str, Any]) -> set[str]:
    return {n for t in panel.get("targets", []) for n in re.findall(r"sdv_fanout_\w+", t["expr"])}


def test_grafana_dashboard_uses_only_metrics_we_export() -> None:
    """Every metric a dashboard panel queries exists in exhook_server.metrics."""
    exported = {
        name
        for m in vars(metrics).values()
        if hasattr(m, "_name")
        for name in (m._name, m._name + "_total", m._name + "_bucket")
    }
    used = {n for p in dashboard_panels() for n in queried(p)}
    assert used and used <= exported, used - exported


def test_grafana_dashboard_has_a_request_lifecycle_row() -> None:
    """The "Request lifecycle" row charts every lifecycle metric, and no two panels share ids or grid cells."""
    panels = dashboard_panels()
    [row] = [p for p in panels if p["type"] == "row" and p["title"] == "Request lifecycle"]
    below = [p for p in panels if p["type"] != "row" and p["gridPos"]["y"] > row["gridPos"]["y"]]
    lifecycle = {
        metrics.ROWS_REFUSED,
        metrics.VEHICLES_AT_BOUND,
        metrics.CANCELS,
        metrics.RESPONSES,
        metrics.AWAITING_RESPONSE,
        metrics.DELIVERIES_FAILED,
        metrics.OUTCOMES,
    }
    names = {m._name for m in lifecycle}
    used = {n.removesuffix("_total") for p in below for n in queried(p)}
    assert names <= used, names - used
    assert len({p["id"] for p in panels}) == len(panels)
    cells = [
        (x, y)
        for p in panels
        for x in range(p["gridPos"]["x"], p["gridPos"]["x"] + p["gridPos"]["w"])
        for y in range(p["gridPos"]["y"], p["gridPos"]["y"] + p["gridPos"]["h"])
    ]
    assert len(cells) == len(set(cells)) and max(x for x, _ in cells) < 24
