"""The container image and the Kubernetes manifests, checked offline (no Docker engine or cluster here)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from exhook_server import metrics
from exhook_server.config import Config, load
from exhook_server.errors import ConfigError
from exhook_server.health import PROCESS_SERVICE
from testkit.harness import BIN, ROOT, SubprocessServer

K8S = ROOT / "deploy" / "k8s"
PG = K8S / "postgresql"
KUBERNETES_VERSIONS = ["1.30.0", "1.37.0"]
#: `kustomize build`, or kubectl's copy of it; the tests that need the real rendering skip without.
KUSTOMIZE = shutil.which("kustomize") or shutil.which("kubectl")


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


def by_kind(kind: str, root: Path = K8S) -> dict[str, Any]:
    [doc] = [d for d in resources(root / "kustomization.yaml") if d["kind"] == kind]
    return doc


def kustomize(root: Path) -> list[dict[str, Any]]:
    """What `kubectl apply -k root` sends: the build with namespace, labels, images and patches applied."""
    if KUSTOMIZE is None:
        pytest.skip("neither kustomize nor kubectl is installed")
    verb = ["build"] if Path(KUSTOMIZE).name == "kustomize" else ["kustomize"]
    out = subprocess.run([KUSTOMIZE, *verb, str(root)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


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
    # Readiness: batches can be stored now (""); startup and liveness: the process serves, so
    # an outage of the database or the broker never restarts the pod (exhook_server/health.py).
    assert c["readinessProbe"]["grpc"].get("service", "") == ""
    assert c["startupProbe"]["grpc"]["service"] == c["livenessProbe"]["grpc"]["service"] == PROCESS_SERVICE


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
    """The optional ServiceMonitor selects the Service both modes share, by its metrics port."""
    [sm] = resources(K8S / "monitoring" / "kustomization.yaml")
    assert sm["kind"] == "ServiceMonitor" and sm["apiVersion"] == "monitoring.coreos.com/v1"
    [service] = [d for d in resources(K8S / "base" / "kustomization.yaml") if d["kind"] == "Service"]
    assert sm["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert sm["spec"]["endpoints"][0]["port"] in {p["name"] for p in service["spec"]["ports"]}


# -- PostgreSQL mode (deploy/k8s/postgresql) -----------------------------------------------------

#: The workload of each mode, by the directory `kubectl apply -k` is given.
WORKLOADS = {K8S: "StatefulSet", PG: "Deployment"}
MODES = [pytest.param(K8S, id="lmdb"), pytest.param(PG, id="postgresql")]
#: What the pod's Secrets hold, for loading its environment as the server would.
SECRET_SAMPLES = {("sdv-fanout-db-app", "uri"): "postgresql://sdv_fanout:pw@sdv-fanout-db-rw.sdv:5432/sdv_fanout"}


def workload(root: Path) -> dict[str, Any]:
    return by_kind(WORKLOADS[root], root)


def container(root: Path) -> dict[str, Any]:
    containers: list[dict[str, Any]] = workload(root)["spec"]["template"]["spec"]["containers"]
    [c] = containers
    return c


def database() -> dict[str, Any]:
    [cluster] = resources(PG / "database" / "kustomization.yaml")
    return cluster


def pod_env(c: dict[str, Any]) -> dict[str, str]:
    """The container's environment as the process sees it: Secrets from SECRET_SAMPLES, the CPU request."""
    env: dict[str, str] = {}
    for e in c["env"]:
        source = e.get("valueFrom", {})
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[e["name"]] = SECRET_SAMPLES.get((ref["name"], ref["key"]), "sample")
        elif "resourceFieldRef" in source:
            assert source["resourceFieldRef"]["resource"] == "requests.cpu"
            env[e["name"]] = c["resources"]["requests"]["cpu"]
        else:
            env[e["name"]] = e["value"]
    return env


def pod_config(root: Path, tmp_path: Path) -> Config:
    """The settings a pod's server runs with: its ConfigMap's config.toml, then its environment."""
    config = tmp_path / "config.toml"
    config.write_text(by_kind("ConfigMap", root)["data"]["config.toml"])
    env = pod_env(container(root))
    assert env["SDV_FANOUT_CONFIG"] == "/etc/sdv-fanout/config.toml"
    return load(config, env=env)


# -- what the kubelet gives each pod ------------------------------------------------------------

#: The Services CloudNativePG creates for a Cluster (`<cluster>-rw`, `-ro`, `-r`), each with one
#: port named `postgres`: in the pods' namespace, so they become service links too.
CNPG_SERVICES = ("-rw", "-ro", "-r")


def shipped_pod_specs() -> list[tuple[str, dict[str, Any]]]:
    """Every pod template of every manifest under deploy/ (Deployments, StatefulSets, Jobs, ...)."""
    found = []
    for path in sorted((ROOT / "deploy").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict):
                continue
            spec = doc.get("spec", {})
            template = spec.get("jobTemplate", {}).get("spec", spec).get("template")
            pod = doc.get("spec") if doc.get("kind") == "Pod" else (template or {}).get("spec")
            if pod and "containers" in pod:
                found.append((f"{path.relative_to(ROOT)}:{doc['kind']}/{doc['metadata']['name']}", pod))
    return found


def namespace_services() -> list[tuple[str, list[tuple[str, int, str]]]]:
    """(name, [(port name, port, protocol)]) of every Service either mode's kustomizations create
    in the namespace, and of the Services CloudNativePG creates for the database Cluster."""
    services: dict[str, list[tuple[str, int, str]]] = {}
    for root in (K8S, PG):
        for doc in resources(root / "kustomization.yaml"):
            if doc["kind"] == "Service":
                ports = [(p.get("name", ""), p["port"], p.get("protocol", "TCP")) for p in doc["spec"]["ports"]]
                services[doc["metadata"]["name"]] = ports
    for suffix in CNPG_SERVICES:
        services[database()["metadata"]["name"] + suffix] = [("postgres", 5432, "TCP")]
    return sorted(services.items())


def service_links(service: str, cluster_ip: str, ports: list[tuple[str, int, str]]) -> dict[str, str]:
    """The variables a kubelet injects for one Service (Kubernetes' pkg/kubelet/envvars): the
    Docker-link style ones for every port, the first port also as `<SVC>_SERVICE_PORT` and
    `<SVC>_PORT`. (The kubelet skips headless Services; they are given links here anyway.)"""
    svc = service.upper().replace("-", "_")
    env = {f"{svc}_SERVICE_HOST": cluster_ip}
    for i, (port_name, port, protocol) in enumerate(ports):
        proto = protocol.lower()
        url = f"{proto}://{f'[{cluster_ip}]' if ':' in cluster_ip else cluster_ip}:{port}"
        if i == 0:
            env[f"{svc}_SERVICE_PORT"] = str(port)
            env[f"{svc}_PORT"] = url
        if port_name:
            env[f"{svc}_SERVICE_PORT_{port_name.upper().replace('-', '_')}"] = str(port)
        link = f"{svc}_PORT_{port}_{protocol.upper()}"
        env.update({link: url, link + "_PROTO": proto, link + "_PORT": str(port), link + "_ADDR": cluster_ip})
    return env


def kubelet_env(c: dict[str, Any], config_file: Path, secrets: dict[tuple[str, str], str]) -> dict[str, str]:
    """The whole environment of the container's process: its own env with the references resolved
    (the ConfigMap mounted at `config_file`), the kubelet's variables, and service links for every
    Service in the namespace (as a pod without `enableServiceLinks: false` would get them)."""
    env = {"HOSTNAME": "sdv-fanout-0", "HOME": "/var/lib/sdv-fanout"}
    env |= service_links("kubernetes", "10.96.0.1", [("https", 443, "TCP")])
    for i, (name, ports) in enumerate(namespace_services()):
        env |= service_links(name, f"10.96.7.{10 + i}", ports)
    own = pod_env(c) | {k: v for (name, key), v in secrets.items() for k in _secret_vars(c, name, key)}
    own["SDV_FANOUT_CONFIG"] = str(config_file)  # the ConfigMap's mount, here
    return env | own


def _secret_vars(c: dict[str, Any], name: str, key: str) -> list[str]:
    return [e["name"] for e in c["env"] if e.get("valueFrom", {}).get("secretKeyRef", {}) == {"name": name, "key": key}]


def test_every_shipped_pod_turns_service_links_off() -> None:
    """Every pod spec under deploy/ sets enableServiceLinks: false: the Services' variables are
    noise in a pod that finds its peers by DNS (the server ignores them anyway)."""
    pods = shipped_pod_specs()
    assert len(pods) >= 2
    assert [where for where, pod in pods if pod.get("enableServiceLinks") is not False] == []


def test_service_link_variables_are_not_settings_but_a_misspelt_setting_is_refused(tmp_path: Path) -> None:
    """Every service link of the namespace is ignored by the loader; a misspelt setting is still
    an error naming the variable."""
    links: dict[str, str] = {}
    for i, (name, ports) in enumerate(namespace_services()):
        links |= service_links(name, f"fd00::{i + 1}" if i % 2 else f"10.96.0.{i + 1}", ports)
    ours = {k: v for k, v in links.items() if k.startswith("SDV_FANOUT_")}
    assert "SDV_FANOUT_DB_RW_PORT_5432_TCP_ADDR" in ours and "SDV_FANOUT_SERVICE_PORT_GRPC" in ours
    assert load(env=ours) == Config()
    assert load(env={"SDV_FANOUT_DB_RW_PORT": "tcp://fd00::7:5432"}) == Config()  # older kubelets: no brackets
    for typo in ({"SDV_FANOUT_MQTT_PASWORD": "x"}, {"SDV_FANOUT_METRICS_PORT": "9100"}):
        with pytest.raises(ConfigError, match=next(iter(typo))):
            load(env=ours | typo)


@pytest.mark.parametrize("root", MODES)
def test_pod_starts_with_the_environment_the_kubelet_gives_it(
    root: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The real server, started with exactly the pod's environment (ConfigMap and Secrets resolved,
    service links for every Service in the namespace), serves: health answers SERVING on its port
    for what each probe asks. Only the addresses are flags: loopback, free ports, a temp data dir."""
    config = tmp_path / "config.toml"
    config.write_text(by_kind("ConfigMap", root)["data"]["config.toml"])
    secrets = dict(SECRET_SAMPLES)
    if root == PG:
        cluster = request.getfixturevalue("pg_cluster")
        secrets[("sdv-fanout-db-app", "uri")] = cluster.new_database(f"kubelet_{os.getpid()}")
    c = container(root)
    env = kubelet_env(c, config, secrets)
    srv = SubprocessServer(
        tmp_path / "lmdb",
        *("--metrics-listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--mqtt-url", ""),
        env=env,
        inherit_env=False,
    )
    try:
        assert len(srv.pids) == int(c["resources"]["requests"]["cpu"])  # SDV_FANOUT_PROCESSES
        with grpc.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                ask = health_pb2.HealthCheckRequest(service=c[probe]["grpc"].get("service", ""))
                answer = health_pb2_grpc.HealthStub(channel).Check(ask, timeout=10)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING, probe
        assert srv.logged("server_group_started")
    finally:
        assert srv.terminate() == 0


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_postgresql_manifests_validate_strictly(version: str) -> None:
    """The PostgreSQL mode's core manifests validate against the Kubernetes schemas, with no StatefulSet."""
    docs = resources(PG / "kustomization.yaml")
    assert sorted(d["kind"] for d in docs) == sorted(
        ["Namespace", "ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "NetworkPolicy"]
    )
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("root", MODES)
def test_pod_settings_load_with_the_server_loader(root: Path, tmp_path: Path) -> None:
    """Each mode's config.toml with its pod's SDV_FANOUT_* variables loads: the server would start on them."""
    cfg = pod_config(root, tmp_path)
    assert cfg.store_url == pod_env(container(root)).get("SDV_FANOUT_STORE_URL", "")
    assert cfg.shutdown_timeout_s < workload(root)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]


def test_postgresql_pods_are_stateless_replicas() -> None:
    """A Deployment of several replicas, no volume claim, nothing mounted but the settings and /tmp."""
    deployment = workload(PG)
    assert deployment["spec"]["replicas"] >= 2
    pod = deployment["spec"]["template"]["spec"]
    assert "volumeClaimTemplates" not in deployment["spec"]
    assert all(set(v) & {"configMap", "emptyDir"} for v in pod["volumes"]), pod["volumes"]
    mounts = {m["mountPath"] for m in container(PG)["volumeMounts"]}
    assert mounts == {"/etc/sdv-fanout", "/tmp"}
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    assert rolling["maxUnavailable"] == 0 and rolling["maxSurge"] >= 1


def test_postgresql_store_url_comes_from_the_database_secret() -> None:
    """SDV_FANOUT_STORE_URL is the `uri` of the Secret CloudNativePG writes for the Cluster, required."""
    [store_url] = [e for e in container(PG)["env"] if e["name"] == "SDV_FANOUT_STORE_URL"]
    ref = store_url["valueFrom"]["secretKeyRef"]
    assert ref == {"name": database()["metadata"]["name"] + "-app", "key": "uri"}
    assert "value" not in store_url and not ref.get("optional", False)


def test_postgresql_pods_close_connections_so_emqx_rebalances(tmp_path: Path) -> None:
    """gRPC max connection age is set, long enough not to churn EMQX's pool; the LMDB pod keeps its one."""
    assert 60 <= pod_config(PG, tmp_path).grpc_max_connection_age_s <= 3600
    assert pod_config(K8S, tmp_path).grpc_max_connection_age_s == 0


def test_postgresql_disruption_budget_lets_one_pod_go() -> None:
    """The PDB allows one pod away at a time (rolling updates, drains) and selects the Deployment's pods."""
    pdb = by_kind("PodDisruptionBudget", PG)["spec"]
    assert pdb["maxUnavailable"] == 1 and "minAvailable" not in pdb
    assert pdb["selector"]["matchLabels"].items() <= workload(PG)["spec"]["template"]["metadata"]["labels"].items()
    assert workload(PG)["spec"]["replicas"] > pdb["maxUnavailable"]
    assert by_kind("PodDisruptionBudget", K8S)["spec"]["maxUnavailable"] == 0  # LMDB: a single writer


def test_postgresql_pod_matches_the_lmdb_pod_where_the_modes_agree() -> None:
    """Image, probes, ports, resources, security and the shared env are the same in both modes' pods."""
    lmdb, pg = container(K8S), container(PG)
    for key in ("image", "ports", "startupProbe", "readinessProbe", "livenessProbe", "resources", "securityContext"):
        assert pg[key] == lmdb[key], key
    lmdb_pod, pg_pod = (workload(r)["spec"]["template"]["spec"] for r in (K8S, PG))
    for key in ("securityContext", "terminationGracePeriodSeconds", "automountServiceAccountToken"):
        assert pg_pod[key] == lmdb_pod[key], key
    assert [e for e in lmdb["env"] if e not in pg["env"]] == []
    lmdb_volumes = {v["name"]: v for v in lmdb_pod["volumes"]}
    assert all(lmdb_volumes[v["name"]] == v for v in pg_pod["volumes"])


def test_service_and_network_policy_select_the_postgresql_pods() -> None:
    """The shared Service and NetworkPolicy match the Deployment's pod labels."""
    labels = workload(PG)["spec"]["template"]["metadata"]["labels"].items()
    assert by_kind("Service", PG)["spec"]["selector"].items() <= labels
    assert by_kind("NetworkPolicy", PG)["spec"]["podSelector"]["matchLabels"].items() <= labels
    assert workload(PG)["spec"]["selector"]["matchLabels"].items() <= labels


def test_database_cluster_commits_on_a_synchronous_standby() -> None:
    """CloudNativePG Cluster: 3 instances, quorum of one synchronous standby, never relaxed, commit waits for it."""
    cluster = database()
    assert (cluster["apiVersion"], cluster["kind"]) == ("postgresql.cnpg.io/v1", "Cluster")
    spec = cluster["spec"]
    sync = spec["postgresql"]["synchronous"]
    assert sync["method"] in ("any", "first") and sync["number"] >= 1
    # One standby more than the quorum needs: either standby may be away without stopping writes.
    assert spec["instances"] >= sync["number"] + 2
    assert sync["dataDurability"] == "required"
    # The older fields and the stanza together are refused by the operator.
    assert not {"minSyncReplicas", "maxSyncReplicas"} & set(spec)
    assert spec["postgresql"]["parameters"]["synchronous_commit"] in ("on", "remote_apply")


def test_database_connections_cover_every_server_process(tmp_path: Path) -> None:
    """max_connections holds every process's pool and policy listener (surge pod included) with room
    for the CLI and the operator."""
    spec = workload(PG)["spec"]
    pods = spec["replicas"] + spec["strategy"]["rollingUpdate"]["maxSurge"]
    processes = pods * int(container(PG)["resources"]["requests"]["cpu"])
    pool = pod_config(PG, tmp_path).store_pool_size
    assert int(database()["spec"]["postgresql"]["parameters"]["max_connections"]) >= processes * (pool + 1) + 20


# -- rendered by kustomize (what `kubectl apply -k` sends) ------------------------------------------


@pytest.mark.parametrize(
    "root", sorted(p.parent for p in K8S.rglob("kustomization.yaml")), ids=lambda p: str(p.relative_to(K8S))
)
def test_every_kustomization_builds(root: Path) -> None:
    """kustomize builds every directory under deploy/k8s (it refuses, say, an overlay inside its base)."""
    assert kustomize(root)


def test_lmdb_mode_renders_one_statefulset_with_its_volume() -> None:
    """deploy/k8s stays the LMDB mode: one StatefulSet replica with a claim, PDB 0, nothing of PostgreSQL."""
    docs = kustomize(K8S)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        ["Namespace", "ConfigMap", "Service", "Service", "StatefulSet", "PodDisruptionBudget", "NetworkPolicy"]
    )
    [sts] = [d for d in docs if d["kind"] == "StatefulSet"]
    assert sts["spec"]["replicas"] == 1 and sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    assert {d["metadata"]["name"] for d in docs if d["kind"] == "Service"} == {"sdv-fanout", "sdv-fanout-headless"}
    [pdb] = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["maxUnavailable"] == 0
    assert all("SDV_FANOUT_STORE_URL" not in json.dumps(d) for d in docs)


def test_postgresql_mode_renders_like_the_lmdb_mode_where_they_agree() -> None:
    """Same namespace, labels, image and settings file as the LMDB mode; no StatefulSet, no headless Service."""
    lmdb, pg = kustomize(K8S), kustomize(PG)
    assert {d["kind"] for d in pg} == {d["kind"] for d in lmdb} - {"StatefulSet"} | {"Deployment"}
    assert [d["metadata"]["name"] for d in pg if d["kind"] == "Service"] == ["sdv-fanout"]
    for doc in pg:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "sdv", doc["kind"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "sdv-fanout", doc["kind"]

    def image(docs: list[dict[str, Any]], kind: str) -> str:
        [d] = [d for d in docs if d["kind"] == kind]
        return str(d["spec"]["template"]["spec"]["containers"][0]["image"])

    assert image(pg, "Deployment") == image(lmdb, "StatefulSet") != "sdv-fanout"
    [pg_cm], [lmdb_cm] = ([d for d in docs if d["kind"] == "ConfigMap"] for docs in (pg, lmdb))
    assert pg_cm == lmdb_cm


def test_database_does_not_carry_the_server_pod_label() -> None:
    """The Cluster is not labelled as the server: the Service and NetworkPolicy select pods by that label."""
    [cluster] = kustomize(PG / "database")
    assert cluster["metadata"]["namespace"] == "sdv"
    assert "app.kubernetes.io/name" not in cluster["metadata"]["labels"]
    assert "app.kubernetes.io/name" not in json.dumps(cluster["spec"])


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


# -- EMQX's side: the emqx-sync Job --------------------------------------------------------------

SYNC = K8S / "emqx-sync"


def sync_job() -> dict[str, Any]:
    [job] = resources(SYNC / "kustomization.yaml")
    return job


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_emqx_sync_job_validates_strictly(version: str) -> None:
    """The Job validates against the Kubernetes schemas, unknown fields rejected."""
    job = sync_job()
    assert job["kind"] == "Job"
    kubernetes_validate.validate(job, version, strict=True)


def test_emqx_sync_job_runs_sync_with_the_api_key_from_a_secret() -> None:
    """`sdv-fanout emqx sync` with the pods' settings file and the key and secret from a Secret (required
    here: without them the Job cannot do anything); a pod the Service does not select, hardened like the server."""
    pod = sync_job()["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert c["command"] + c["args"] == ["sdv-fanout", "emqx", "sync"]
    env = {e["name"]: e for e in c["env"]}
    assert env["SDV_FANOUT_CONFIG"]["value"] == "/etc/sdv-fanout/config.toml"
    for name in ("SDV_FANOUT_EMQX_API_KEY", "SDV_FANOUT_EMQX_API_SECRET"):
        ref = env[name]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "sdv-fanout-emqx-api" and not ref.get("optional", False)
    assert [v["configMap"]["name"] for v in pod["volumes"]] == [by_kind("ConfigMap")["metadata"]["name"]]
    service = by_kind("Service", K8S / "base")
    labels = sync_job()["spec"]["template"]["metadata"]["labels"]
    assert not service["spec"]["selector"].items() <= labels.items()
    assert pod["securityContext"]["runAsNonRoot"] and c["securityContext"]["readOnlyRootFilesystem"]
    assert pod["enableServiceLinks"] is False and pod["restartPolicy"] == "OnFailure"


@pytest.mark.parametrize("root", MODES)
def test_emqx_sync_job_and_the_pods_want_the_same_from_emqx(root: Path, tmp_path: Path) -> None:
    """The Job (settings file only) and each mode's pods (file and environment, which sync at start)
    want the same ExHook entry, hook list and rule: else each sync would undo the other's. The
    entry's URL is the Service; the pods' API key is optional (a missing one is logged, not fatal)."""
    from exhook_server import emqx_sync

    job = Config(**tomllib.loads(by_kind("ConfigMap")["data"]["config.toml"]))
    pods = pod_config(root, tmp_path)
    assert pods.emqx_sync_on_start and pods.emqx_api_url
    assert emqx_sync.wanted_exhook(job) == emqx_sync.wanted_exhook(pods)
    assert emqx_sync.wanted_hooks(job) == emqx_sync.wanted_hooks(pods)
    assert emqx_sync.wanted_rule(job, [(5, 8, 9)]) == emqx_sync.wanted_rule(pods, [(5, 8, 9)])
    service = by_kind("Service", K8S / "base")
    [grpc] = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    assert job.exhook_url == f"http://{service['metadata']['name']}.sdv.svc:{grpc['port']}"
    for e in container(root)["env"]:
        if e["name"].startswith("SDV_FANOUT_EMQX_API_"):
            assert e["valueFrom"]["secretKeyRef"]["optional"] is True


def test_grafana_dashboard_has_a_campaigns_row() -> None:
    """The "Campaigns" row charts every campaign-control metric: policies, held and paced campaigns,
    paced starts, aborts, vehicles waiting for capacity, the delivery budget and previews."""
    panels = dashboard_panels()
    [row] = [p for p in panels if p["type"] == "row" and p["title"] == "Campaigns"]
    below = [p for p in panels if p["type"] != "row" and p["gridPos"]["y"] > row["gridPos"]["y"]]
    campaign = {
        metrics.POLICIES_SET,
        metrics.CAMPAIGNS_HELD,
        metrics.CAMPAIGNS_PACED,
        metrics.PACED_STARTS,
        metrics.ABORTS,
        metrics.PACING_IDLE_VEHICLES,
        metrics.DELIVERIES_DEFERRED,
        metrics.DELIVERIES_WAITING,
        metrics.BATCHES_PREVIEWED,
    }
    names = {m._name for m in campaign}
    used = {n.removesuffix("_total") for p in below for n in queried(p)}
    assert names <= used, names - used
