"""The kvmesh services as Kubernetes workloads: a Deployment per control service, a StatefulSet per
engine role, their Services, ServiceAccounts, PodDisruptionBudgets and admission's autoscaler.

Ports and env names come from the loaded configs (cluster.py); probes are the `/health` and `/ready`
every kvmesh service serves (libs/controlplane/service.py).
"""

from __future__ import annotations

from typing import Any

from .cluster import CONFIG_DIR, ENGINE_ROLES, NAMESPACE, SECRET, Cluster, name_of

IMAGE = "kvmesh"  # the overlays pin the registry and tag (kustomize `images`)
CONFIG_FILE = f"{CONFIG_DIR}/kvmesh.toml"
HEALTH, READY, METRICS = "/health", "/ready", "/metrics"
POLICY_SERVICES = ("predictor", "scheduler")  # swappable: their Service selects an implementation label
IMPLEMENTATION = "kvmesh.dev/implementation"
BUILTIN = "builtin"

# requests / limits per container on the base (CPU) deployment; gpu-rdma patches the engines.
RESOURCES = {
    "kvmeta": ({"cpu": "100m", "memory": "128Mi"}, {"cpu": "1", "memory": "512Mi"}),
    "predictor": ({"cpu": "250m", "memory": "1Gi"}, {"cpu": "2", "memory": "2Gi"}),
    "scheduler": ({"cpu": "100m", "memory": "128Mi"}, {"cpu": "1", "memory": "512Mi"}),
    "admission": ({"cpu": "250m", "memory": "512Mi"}, {"cpu": "2", "memory": "1Gi"}),
    "engine": ({"cpu": "1", "memory": "2Gi"}, {"cpu": "2", "memory": "4Gi"}),
}
REPLICAS = {"kvmeta": 2, "predictor": 1, "scheduler": 2}
ADMISSION_REPLICAS = (2, 10)  # the autoscaler's range; the Deployment leaves its count to the autoscaler
ADMISSION_CPU_TARGET = 70  # percent of the CPU request
# An engine builds its model and profiles its tiers before it serves: give it time to start.
STARTUP_GRACE_S = {"engine": 600, "predictor": 180}
TERMINATION_GRACE_S = {"engine": 60, "admission": 60}  # streams to finish or abort cleanly


def labels(component: str, **extra: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "kvmesh", "app.kubernetes.io/component": component,
            "app": name_of(component), **extra}


def meta(name: str, component: str, **extra: str) -> dict[str, Any]:
    return {"name": name, "namespace": NAMESPACE, "labels": labels(component, **extra)}


def service_account(service: str) -> dict[str, Any]:
    """One per service: the mesh's AuthorizationPolicies name callers by it."""
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(name_of(service), service)}


def _probe(path: str, period_s: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period_s, "timeoutSeconds": 2,
            "failureThreshold": failures}


def _env(name: str, value: str | None = None, **source: Any) -> dict[str, Any]:
    return {"name": name, "value": value} if value is not None else {"name": name, "valueFrom": source}


def container(cluster: Cluster, service: str, extra_env: list[dict[str, Any]] = ()) -> dict[str, Any]:
    ports = cluster.ports(service)
    requests, limits = RESOURCES[service]
    grace = STARTUP_GRACE_S.get(service, 60)
    declared = [{"name": "http", "containerPort": ports.http, "protocol": "TCP"}]
    if ports.data is not None:
        declared.append({"name": "kv-data", "containerPort": ports.data, "protocol": "TCP"})
    return {
        "name": service,
        "image": IMAGE,
        "command": ["kvmesh", "serve", service],
        "env": [_env("KVMESH_CONFIG", CONFIG_FILE),
                _env("KVMESH_TOKEN", secretKeyRef={"name": SECRET, "key": "token"}),
                *extra_env],
        "ports": declared,
        "startupProbe": _probe(HEALTH, 5, grace // 5),
        "livenessProbe": _probe(HEALTH, 10, 3),
        "readinessProbe": _probe(READY, 5, 2),
        "resources": {"requests": requests, "limits": limits},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }


def pod_spec(cluster: Cluster, service: str, extra_env: list[dict[str, Any]] = (),
             config_map: str | None = None) -> dict[str, Any]:
    return {
        "serviceAccountName": name_of(service),
        "securityContext": {"runAsNonRoot": True, "runAsUser": 10001, "fsGroup": 10001},
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S.get(service, 30),
        "containers": [container(cluster, service, extra_env)],
        "volumes": [{"name": "config", "configMap": {"name": config_map or f"{name_of(service)}-config"}},
                    {"name": "tmp", "emptyDir": {}}],
    }


def pod_annotations(cluster: Cluster, service: str) -> dict[str, str]:
    """Prometheus scrapes every pod that asks to be (under Istio, through the sidecar's merged metrics)."""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(cluster.ports(service).http),
            "prometheus.io/path": METRICS}


def threads_env(service: str) -> list[dict[str, Any]]:
    """torch threads = the CPUs the container may use, so engines on one node do not fight for cores."""
    return [_env(f"KVMESH_{service.upper()}_TORCH_THREADS",
                 resourceFieldRef={"containerName": service, "resource": "limits.cpu", "divisor": "1"})]


def service_env(service: str) -> list[dict[str, Any]]:
    if service == "predictor":
        return threads_env(service)
    if service == "admission":  # a JSON list of keys
        return [_env("KVMESH_ADMISSION_API_KEYS", secretKeyRef={"name": SECRET, "key": "api-keys"})]
    return []


def deployment(cluster: Cluster, service: str, implementation: str = BUILTIN) -> dict[str, Any]:
    """A control service's Deployment; a policy service's pods carry their implementation's label,
    which its Service selects (another implementation of the same API: docs/deploy.md)."""
    name = name_of(service) if implementation == BUILTIN else f"{name_of(service)}-{implementation}"
    selector = labels(service, **({IMPLEMENTATION: implementation} if service in POLICY_SERVICES else {}))
    replicas = {"replicas": REPLICAS[service]} if service in REPLICAS else {}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(name, service),
        "spec": {
            **replicas,
            "selector": {"matchLabels": selector},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": {"metadata": {"labels": selector, "annotations": pod_annotations(cluster, service)},
                         "spec": pod_spec(cluster, service, service_env(service), f"{name}-config")},
        },
    }


def engine_name(role: str) -> str:
    return f"{name_of('engine')}-{role}"


def engine_statefulset(cluster: Cluster, role: str) -> dict[str, Any]:
    """Engines register in kvmeta under their pod name and are reached at their stable DNS name."""
    name, ports = engine_name(role), cluster.ports("engine")
    pod_labels = labels("engine", **{"kvmesh.dev/role": role})
    env = [_env("POD_NAME", fieldRef={"fieldPath": "metadata.name"}),
           _env("POD_NAMESPACE", fieldRef={"fieldPath": "metadata.namespace"}),
           _env("POD_IP", fieldRef={"fieldPath": "status.podIP"}),
           _env("KVMESH_ENGINE_ROLE", role),
           _env("KVMESH_ENGINE_ENGINE_ID", "$(POD_NAME)"),
           _env("KVMESH_ENGINE_ADVERTISE_URL", f"http://$(POD_NAME).{name}.$(POD_NAMESPACE).svc:{ports.http}"),
           _env("KVMESH_ENGINE_DATA_HOST", "$(POD_IP)"),
           *threads_env("engine")]
    spec = pod_spec(cluster, "engine", env)
    spec["containers"][0]["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
    spec["volumes"].append({"name": "dshm", "emptyDir": {"medium": "Memory"}})  # torch's shared-memory tensors
    annotations = {**pod_annotations(cluster, "engine"),
                   # KV bytes go engine to engine on the data port, one-sided reads with no proxy in the
                   # way: the sidecar must not capture that port, inbound or outbound (docs/deploy.md).
                   "traffic.sidecar.istio.io/excludeInboundPorts": str(ports.data),
                   "traffic.sidecar.istio.io/excludeOutboundPorts": str(ports.data)}
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": meta(name, "engine", **{"kvmesh.dev/role": role}),
        "spec": {
            "serviceName": name,
            "replicas": 1,
            "podManagementPolicy": "Parallel",  # engines do not depend on each other to start
            "selector": {"matchLabels": pod_labels},
            "template": {"metadata": {"labels": pod_labels, "annotations": annotations}, "spec": spec},
        },
    }


def service(cluster: Cluster, svc: str) -> dict[str, Any]:
    selector = labels(svc, **({IMPLEMENTATION: BUILTIN} if svc in POLICY_SERVICES else {}))
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta(name_of(svc), svc),
            "spec": {"selector": selector,
                     "ports": [{"name": "http", "port": cluster.ports(svc).http, "targetPort": "http"}]}}


def engine_service(cluster: Cluster, role: str) -> dict[str, Any]:
    """Headless: each engine pod gets a DNS name of its own, the one it registers."""
    ports = cluster.ports("engine")
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": meta(engine_name(role), "engine", **{"kvmesh.dev/role": role}),
            "spec": {"clusterIP": "None", "selector": labels("engine", **{"kvmesh.dev/role": role}),
                     "ports": [{"name": "http", "port": ports.http, "targetPort": "http"},
                               {"name": "tcp-kv-data", "port": ports.data, "targetPort": "kv-data"}]}}


def disruption_budget(name: str, component: str, selector: dict[str, str]) -> dict[str, Any]:
    """At most one pod of each kind down at a time for voluntary disruptions (drains, upgrades)."""
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": meta(name, component),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}}}


def admission_autoscaler() -> dict[str, Any]:
    name = name_of("admission")
    return {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": meta(name, "admission"),
            "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
                     "minReplicas": ADMISSION_REPLICAS[0], "maxReplicas": ADMISSION_REPLICAS[1],
                     "metrics": [{"type": "Resource", "resource": {
                         "name": "cpu", "target": {"type": "Utilization", "averageUtilization": ADMISSION_CPU_TARGET}}}]}}


def service_documents(cluster: Cluster, svc: str) -> list[dict[str, Any]]:
    """Everything one service needs but its ConfigMap (kustomize generates that from its TOML file)."""
    if svc == "engine":
        docs: list[dict[str, Any]] = [service_account("engine")]
        for role in ENGINE_ROLES:
            docs += [engine_service(cluster, role), engine_statefulset(cluster, role),
                     disruption_budget(engine_name(role), "engine", labels("engine", **{"kvmesh.dev/role": role}))]
        return docs
    docs = [service_account(svc), service(cluster, svc), deployment(cluster, svc),
            disruption_budget(name_of(svc), svc, labels(svc))]
    return docs + [admission_autoscaler()] if svc == "admission" else docs
