"""infra/k8s: every overlay renders with kustomize, validates against the Kubernetes schemas offline,
and cannot drift from the code: the ports, env names, config files and probe paths in the manifests
are checked against what each service reads (its Config, through its own load_config) and serves
(its OpenAPI description), and every name one manifest gives another resolves.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest

from kvmesh.infra.k8s import cluster, mesh
from kvmesh.infra.k8s.generate import generated_files, stale
from kvmesh.infra.k8s.render import K8S, REPO, build, kustomize_command, overlays, render
from kvmesh.infra.k8s.workloads import IMPLEMENTATION
from kvmesh.libs.controlplane import ServiceConfig, load_config
from kvmesh.services.configs import config_class

from .manifests import (by_kind, env_of, kvmesh_containers, mounted_config_map, named, pod_templates,
                        selects)

pytestmark = pytest.mark.skipif(kustomize_command() is None, reason="no kustomize: scripts/setup.sh installs one")

KUBERNETES_VERSIONS = ("1.31.0", "1.37.0")  # an older supported release and the newest the schemas know
# Custom resources kubernetes-validate has no schema for: Istio's, and Multus' network attachment.
CUSTOM_KINDS = {("security.istio.io/v1", "PeerAuthentication"), ("security.istio.io/v1", "AuthorizationPolicy"),
                ("networking.istio.io/v1", "DestinationRule"), ("networking.istio.io/v1", "VirtualService"),
                ("k8s.cni.cncf.io/v1", "NetworkAttachmentDefinition")}
OPERATOR_SECRETS = {"gpu-rdma": {cluster.SECRET}}  # made by the operator, not by the overlay
API = REPO / "docs" / "api"


@pytest.fixture(scope="module", params=overlays())
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


def test_there_are_the_two_overlays():
    assert overlays() == ["cpu-dev", "gpu-rdma"]


def test_generated_files_are_current():
    """The base, the components, the overlays' TOML files and docs/api come from the code; a change
    there must be followed by `python -m kvmesh.infra.k8s.generate`."""
    outdated = stale(generated_files())
    assert not outdated, f"stale, run `python -m kvmesh.infra.k8s.generate`: {[str(p) for p in outdated]}"


def test_every_document_validates_against_the_kubernetes_schemas(overlay):
    name, documents = overlay
    for document in documents:
        if (document["apiVersion"], document["kind"]) in CUSTOM_KINDS:
            assert document["metadata"]["name"] and isinstance(document["spec"], dict)
            continue
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(document, version, strict=True)


def test_names_are_unique_and_namespaced(overlay):
    _, documents = overlay
    keys = [(d["kind"], d["metadata"]["name"]) for d in documents]
    assert len(keys) == len(set(keys))
    assert all(d["metadata"].get("namespace") == cluster.NAMESPACE for d in documents if d["kind"] != "Namespace")


def _loaded(documents: list[dict[str, Any]], item, tmp_path: Path) -> tuple[ServiceConfig, dict[str, str]]:
    """The container's config as its service will load it: the mounted TOML file and its env."""
    config_map = named(documents, "ConfigMap", mounted_config_map(item, cluster.CONFIG_DIR))
    env = env_of(item.container)
    path = tmp_path / f"{item.workload['metadata']['name']}.toml"
    path.write_text(config_map["data"]["kvmesh.toml"])
    assert env["KVMESH_CONFIG"] == f"{cluster.CONFIG_DIR}/kvmesh.toml"
    return load_config(config_class(item.service), item.service, path, env=env), env


def test_each_service_reads_its_env_and_config_file(overlay, tmp_path):
    """Every KVMESH_ variable names a field the service reads, and the file plus the env load."""
    _, documents = overlay
    items = kvmesh_containers(documents)
    assert {i.service for i in items} == set(cluster.SERVICES)
    for item in items:
        fields = set(config_class(item.service).__struct_fields__)
        config, env = _loaded(documents, item, tmp_path)
        for variable in env:
            if not variable.startswith("KVMESH_") or variable == "KVMESH_CONFIG":
                continue
            field = variable.removeprefix("KVMESH_")
            field = field.removeprefix(f"{item.service.upper()}_") if field.lower() not in fields else field
            assert field.lower() in fields, f"{item.service} reads no {variable}"
        assert config.host == "0.0.0.0"
        assert config.token == "cluster-token"


def _openapi_paths(service: str) -> set[str]:
    return set(json.loads((API / f"{service}.openapi.json").read_text())["paths"])


def test_ports_and_probes_are_what_each_service_listens_on_and_serves(overlay, tmp_path):
    _, documents = overlay
    for item in kvmesh_containers(documents):
        config, _ = _loaded(documents, item, tmp_path)
        assert item.ports["http"] == config.port
        if item.service == "engine":
            assert item.ports["kv-data"] == config.data_port
            annotations = item.pod["metadata"]["annotations"]
            for direction in ("Inbound", "Outbound"):
                assert annotations[f"traffic.sidecar.istio.io/exclude{direction}Ports"] == str(config.data_port)
        assert item.pod["metadata"]["annotations"]["prometheus.io/port"] == str(config.port)
        served = _openapi_paths(item.service)
        for kind, path in (("livenessProbe", "/health"), ("readinessProbe", "/ready"), ("startupProbe", "/health")):
            probe = item.container[kind]["httpGet"]
            assert probe["path"] == path and path in served
            assert probe["port"] in item.ports


def _service_port(documents: list[dict[str, Any]], host: str, port: int) -> dict[str, Any]:
    """The rendered Service a URL's host names, and check it exposes the port."""
    service = named(documents, "Service", host.split(".")[0])
    assert port in [p["port"] for p in service["spec"]["ports"]], f"{host} does not expose {port}"
    return service


def test_every_address_in_a_config_is_a_rendered_service_at_that_services_port(overlay, tmp_path):
    _, documents = overlay
    items = {i.service: i for i in kvmesh_containers(documents)}
    configs = {service: _loaded(documents, item, tmp_path)[0] for service, item in items.items()}
    urls = [configs["scheduler"].kvmeta_url, configs["engine"].kvmeta_url,
            configs["admission"].scheduler_url, configs["admission"].predictor_url]
    for url in urls:
        parts = urlsplit(url)
        service = _service_port(documents, parts.hostname, parts.port)
        target = parts.hostname.removeprefix("kvmesh-")
        assert parts.port == configs[target].port
        assert any(selects(service["spec"]["selector"], pod) for _, pod in pod_templates(documents))
    otlp = urlsplit(configs["admission"].otlp_endpoint)
    _service_port(documents, otlp.hostname, otlp.port)
    for address in configs["kvmeta"].redis_sentinels:
        host, port = address.rsplit(":", 1)
        pod, headless = host.split(".")
        redis = named(documents, "StatefulSet", headless)
        assert pod.rsplit("-", 1)[0] == headless and int(pod.rsplit("-", 1)[1]) < redis["spec"]["replicas"]
        _service_port(documents, headless, int(port))
    for item in kvmesh_containers(documents):
        if item.service == "engine":
            config, env = _loaded(documents, item, tmp_path)
            advertised = urlsplit(config.advertise_url)
            _, headless, *_ = advertised.hostname.split(".")
            assert headless == item.workload["spec"]["serviceName"]
            assert named(documents, "Service", headless)["spec"]["clusterIP"] == "None"
            _service_port(documents, headless, config.port)
            assert advertised.port == config.port and config.engine_id == env["POD_NAME"]


def test_services_reach_their_pods_by_port_name(overlay):
    _, documents = overlay
    for service in by_kind(documents, "Service"):
        pods = [pod for _, pod in pod_templates(documents) if selects(service["spec"]["selector"], pod)]
        assert pods, f"Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            for pod in pods:
                declared = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
                target = port.get("targetPort", port["port"])
                assert target in declared or target in declared.values(), (service["metadata"]["name"], target)
                if isinstance(target, str):
                    assert declared[target] == port["port"]


def test_what_pods_refer_to_exists(overlay):
    """ConfigMaps (with kustomize's hash suffixes), Secrets, claims and ServiceAccounts."""
    name, documents = overlay
    config_maps = {d["metadata"]["name"] for d in by_kind(documents, "ConfigMap")}
    secrets = {d["metadata"]["name"] for d in by_kind(documents, "Secret")} | OPERATOR_SECRETS.get(name, set())
    claims = {d["metadata"]["name"] for d in by_kind(documents, "PersistentVolumeClaim")}
    accounts = {d["metadata"]["name"] for d in by_kind(documents, "ServiceAccount")}
    for _, pod in pod_templates(documents):
        spec = pod["spec"]
        assert spec["serviceAccountName"] in accounts
        for volume in spec.get("volumes", []):
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
        for container in spec["containers"]:
            for entry in container.get("env", []):
                ref = entry.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    assert ref["name"] in secrets, f"no Secret {ref['name']}"


def test_budgets_and_the_autoscaler_cover_real_workloads(overlay):
    _, documents = overlay
    for budget in by_kind(documents, "PodDisruptionBudget"):
        assert any(selects(budget["spec"]["selector"]["matchLabels"], pod) for _, pod in pod_templates(documents))
    covered = {w["metadata"]["name"] for w, pod in pod_templates(documents)
               if any(selects(b["spec"]["selector"]["matchLabels"], pod) for b in by_kind(documents, "PodDisruptionBudget"))}
    assert {cluster.name_of(s) for s in ("kvmeta", "predictor", "scheduler", "admission")} <= covered
    assert {f"kvmesh-engine-{role}" for role in cluster.ENGINE_ROLES} <= covered
    autoscaler = named(documents, "HorizontalPodAutoscaler", "kvmesh-admission")
    named(documents, autoscaler["spec"]["scaleTargetRef"]["kind"], autoscaler["spec"]["scaleTargetRef"]["name"])


def test_only_idempotent_routes_retry_and_streams_never_time_out(overlay):
    _, documents = overlay
    services = {d["metadata"]["name"]: d for d in by_kind(documents, "Service")}
    virtual_services = by_kind(documents, "VirtualService")
    assert {v["metadata"]["name"] for v in virtual_services} == {cluster.name_of(s) for s in
                                                                ("kvmeta", "predictor", "scheduler", "admission")}
    for virtual in virtual_services:
        component = virtual["metadata"]["labels"]["app.kubernetes.io/component"]
        served = _openapi_paths(component)
        for route in virtual["spec"]["http"]:
            for destination in route["route"]:
                service = services[destination["destination"]["host"]]
                assert destination["destination"]["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
            matches = route.get("match", [])
            if route["retries"]["attempts"] > 0:
                assert matches and all(m["method"]["exact"] in mesh.IDEMPOTENT and "uri" not in m for m in matches)
            for match in matches:
                if "uri" in match:  # a stream: exact path of a route the service serves, no timeout
                    assert match["uri"]["exact"] in served and route["timeout"] == "0s"
        assert virtual["spec"]["http"][-1].get("match") is None and virtual["spec"]["http"][-1]["retries"]["attempts"] == 0


def test_authorization_names_real_callers_and_real_workloads(overlay):
    _, documents = overlay
    accounts = {d["metadata"]["name"] for d in by_kind(documents, "ServiceAccount")}
    policies = by_kind(documents, "AuthorizationPolicy")
    assert any(p["spec"] == {} for p in policies), "no allow-nothing default"
    for policy in policies:
        if policy["spec"] == {}:
            continue
        selector = policy["spec"]["selector"]["matchLabels"]
        assert any(selects(selector, pod) for _, pod in pod_templates(documents)), policy["metadata"]["name"]
        for rule in policy["spec"]["rules"]:
            for source in rule.get("from", []):
                for principal in source["source"]["principals"]:
                    namespace, account = principal.split("/ns/")[1].split("/sa/")
                    assert namespace == cluster.NAMESPACE and account in accounts
    engines = next(p for p in policies if p["metadata"]["name"] == "kvmesh-engine-callers")
    assert engines["spec"]["rules"] == [{"from": [{"source": {"principals": [
        f"cluster.local/ns/{cluster.NAMESPACE}/sa/kvmesh-admission"]}}]}]


def test_the_data_plane_port_admits_only_engines(overlay):
    _, documents = overlay
    policy = named(documents, "NetworkPolicy", "kvmesh-engine-data-plane")
    engines = [pod for _, pod in pod_templates(documents) if selects(policy["spec"]["podSelector"]["matchLabels"], pod)]
    assert engines and all(pod["metadata"]["labels"]["app.kubernetes.io/component"] == "engine" for pod in engines)
    data_rule = next(r for r in policy["spec"]["ingress"] if "from" in r)
    assert data_rule["ports"] == [{"protocol": "TCP", "port": "kv-data"}]
    assert data_rule["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/component": "engine"}}}]
    assert all(p["port"] != "kv-data" for r in policy["spec"]["ingress"] if "from" not in r for p in r["ports"])


def test_the_dashboards_are_observability_dashboards(overlay):
    _, documents = overlay
    mounted = named(documents, "ConfigMap", next(
        v["configMap"]["name"] for w, pod in pod_templates(documents) if w["metadata"]["name"] == "kvmesh-grafana"
        for v in pod["spec"]["volumes"] if v["name"] == "dashboards"))
    on_disk = {p.name: json.loads(p.read_text()) for p in (REPO / "observability" / "dashboards").glob("*.json")}
    assert {name: json.loads(text) for name, text in mounted["data"].items()} == on_disk


def test_redis_sentinel_monitors_the_master_kvmeta_asks_for(overlay, tmp_path):
    _, documents = overlay
    kvmeta = next(i for i in kvmesh_containers(documents) if i.service == "kvmeta")
    config, _ = _loaded(documents, kvmeta, tmp_path)
    redis = named(documents, "StatefulSet", cluster.REDIS)
    for container in redis["spec"]["template"]["spec"]["containers"]:
        assert {"name": "MASTER_NAME", "value": config.redis_master} in container["env"]
    assert redis["spec"]["replicas"] == len(config.redis_sentinels)


def test_gpu_rdma_engines_get_a_gpu_a_paired_rdma_function_and_the_verbs_data_plane(tmp_path):
    documents = render("gpu-rdma")
    network = named(documents, "NetworkAttachmentDefinition", "kvmesh-rdma")
    resource = network["metadata"]["annotations"]["k8s.v1.cni.cncf.io/resourceName"]
    assert {p["type"] for p in json.loads(network["spec"]["config"])["plugins"]} == {"sriov", "rdma"}
    for item in (i for i in kvmesh_containers(documents) if i.service == "engine"):
        limits = item.container["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "1" and limits[resource] == "1"
        assert "IPC_LOCK" in item.container["securityContext"]["capabilities"]["add"]
        assert item.pod["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "kvmesh-rdma@net1"
        config, _ = _loaded(documents, item, tmp_path)
        assert (config.dataplane, config.device) == ("verbs", "cuda")
        # the data plane on the VF's interface, which is also what keeps it out of the sidecar
        assert (config.data_interface, config.rdma_device) == ("net1", "auto")
        assert item.pod["metadata"]["annotations"]["traffic.sidecar.istio.io/excludeInterfaces"] == config.data_interface
        assert config.model.startswith("/models/")
        assert any(m["mountPath"] == "/models" for m in item.container["volumeMounts"])


def test_cpu_dev_runs_the_tiny_model_on_the_cpu_with_its_own_dev_secret(tmp_path):
    documents = render("cpu-dev")
    secret = next(d for d in by_kind(documents, "Secret") if d["metadata"]["name"].startswith(cluster.SECRET))
    assert set(secret["data"]) >= {"token", "api-keys"}
    for item in kvmesh_containers(documents):
        config, _ = _loaded(documents, item, tmp_path)
        if item.service == "engine":
            assert (config.model, config.device, config.dataplane) == ("tiny", "cpu", "tcp")
        assert tomllib.loads(named(documents, "ConfigMap", mounted_config_map(item, cluster.CONFIG_DIR))
                             ["data"]["kvmesh.toml"])["trace_sample"] == 1.0



def test_swapping_the_predictor_changes_its_service_selector_and_restarts_nothing_else(tmp_path):
    """examples/swap-predictor on cpu-dev: a second Deployment speaking the predictor's API, and the
    Service switched to it. Every other document, pod templates and their hashed ConfigMap names
    included, is byte for byte what it was, so no other pod rolls."""
    before = {(d["kind"], d["metadata"]["name"]): d for d in render("cpu-dev")}
    after = {(d["kind"], d["metadata"]["name"]): d for d in build(K8S / "examples" / "swap-predictor")}
    swap = cluster.SWAP_EXAMPLE
    service_key = ("Service", cluster.name_of(swap.service))
    added = set(after) - set(before)
    assert {kind for kind, _ in added} == {"Deployment", "ConfigMap"} and not set(before) - set(after)
    assert [key for key in before if before[key] != after[key]] == [service_key]
    selector = after[service_key]["spec"]["selector"]
    assert selector == {**before[service_key]["spec"]["selector"], IMPLEMENTATION: swap.implementation}
    serving = [item for item in kvmesh_containers(list(after.values())) if selects(selector, item.pod)]
    assert [item.workload["metadata"]["name"] for item in serving] == [f"kvmesh-{swap.service}-{swap.implementation}"]
    config, _ = _loaded(list(after.values()), serving[0], tmp_path)
    assert config.predictor == "rlp" and serving[0].ports["http"] == config.port
    assert config.port in [p["port"] for p in after[service_key]["spec"]["ports"]]
