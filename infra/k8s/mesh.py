"""The service mesh (Istio) around kvmesh, and the network policy for what the mesh cannot see.

- mTLS between all pods of the namespace (PeerAuthentication STRICT).
- Retries and timeouts only on idempotent internal routes (GET, PUT, DELETE), derived from each
  service's route table; every other route is told explicitly not to retry (Istio retries by
  default), and streams get no timeout.
- Who may call whom, by the caller's ServiceAccount: only admission reaches the engines' control
  APIs, the predictor and the scheduler; only engines and the scheduler reach kvmeta; only kvmeta
  (and Redis itself) reaches Redis. Everything else is denied (allow-nothing).
- The engines' KV data-plane port bypasses the sidecars (workloads.py: excluded from capture): a
  proxy would copy every KV byte and add a hop to one-sided reads, and RDMA never passes through
  the kernel's network stack at all. An AuthorizationPolicy cannot see that port, so a Kubernetes
  NetworkPolicy admits only engine pods to it (and CONNECT needs the cluster token besides).
"""

from __future__ import annotations

from typing import Any

from .cluster import NAMESPACE, Cluster, name_of
from .workloads import meta

ISTIO_SECURITY = "security.istio.io/v1"
ISTIO_NETWORKING = "networking.istio.io/v1"
IDEMPOTENT = ("GET", "PUT", "DELETE")
# Routes that stream for as long as a request (or a watcher) lives: never a mesh timeout.
STREAMS = {"kvmeta": [("GET", "/v1/workers/watch")],
           "engine": [("POST", "/v1/generate"), ("POST", "/v1/prefill"), ("POST", "/v1/decode")]}
RETRY = {"attempts": 2, "perTryTimeout": "2s", "retryOn": "connect-failure,refused-stream,reset,503"}
IDEMPOTENT_TIMEOUT = "6s"
# Which callers each workload admits, by ServiceAccount. Probes and Prometheus go to the sidecar
# agent's port, not through these policies.
CALLERS = {"engine": ["admission"], "predictor": ["admission"], "scheduler": ["admission"],
           "kvmeta": ["engine", "scheduler"], "redis": ["kvmeta", "redis"],
           # components/observability, when deployed: spans come from every service; Grafana reads the stores.
           "otel-collector": ["kvmeta", "predictor", "scheduler", "engine", "admission"],
           "jaeger": ["otel-collector", "grafana"], "prometheus": ["grafana"]}
PUBLIC = ("admission", "grafana")  # anyone may call: admission checks API keys, Grafana its own login
MESH_PORTS = (15020, 15021, 15090)  # Istio's agent: merged metrics, health, Envoy stats


def _principal(service: str) -> str:
    return f"cluster.local/ns/{NAMESPACE}/sa/{name_of(service)}"


def peer_authentication() -> dict[str, Any]:
    return {"apiVersion": ISTIO_SECURITY, "kind": "PeerAuthentication",
            "metadata": {"name": "kvmesh-mtls", "namespace": NAMESPACE}, "spec": {"mtls": {"mode": "STRICT"}}}


def allow_nothing() -> dict[str, Any]:
    """No workload in the namespace takes a call no ALLOW policy below names."""
    return {"apiVersion": ISTIO_SECURITY, "kind": "AuthorizationPolicy",
            "metadata": {"name": "kvmesh-allow-nothing", "namespace": NAMESPACE}, "spec": {}}


def allow(component: str, callers: list[str] | None) -> dict[str, Any]:
    """`component`'s pods take calls from these callers' ServiceAccounts; None: from anyone (the
    public front door, whose own API keys guard it)."""
    rule = {"from": [{"source": {"principals": [_principal(c) for c in callers]}}]} if callers else {}
    return {"apiVersion": ISTIO_SECURITY, "kind": "AuthorizationPolicy",
            "metadata": meta(f"{name_of(component)}-callers", component),
            "spec": {"selector": {"matchLabels": {"app.kubernetes.io/component": component}},
                     "action": "ALLOW", "rules": [rule]}}


def destination_rule(service: str) -> dict[str, Any]:
    return {"apiVersion": ISTIO_NETWORKING, "kind": "DestinationRule", "metadata": meta(name_of(service), service),
            "spec": {"host": name_of(service), "trafficPolicy": {
                "tls": {"mode": "ISTIO_MUTUAL"},
                "outlierDetection": {"consecutive5xxErrors": 5, "interval": "10s", "baseEjectionTime": "30s"}}}}


def virtual_service(cluster: Cluster, service: str, operations: list[tuple[str, str]]) -> dict[str, Any]:
    """Streams first (no timeout, no retry), then idempotent methods (timeout, retries), then the
    rest (no retry: a POST may have been acted on before the failure)."""
    destination = [{"destination": {"host": name_of(service), "port": {"number": cluster.ports(service).http}}}]
    no_retry = {"attempts": 0}
    http = []
    streams = STREAMS.get(service, [])
    if streams:
        http.append({"name": "streams", "match": [{"method": {"exact": m}, "uri": {"exact": p}} for m, p in streams],
                     "route": destination, "timeout": "0s", "retries": no_retry})
    methods = sorted({m for m, _ in operations if m in IDEMPOTENT})
    if methods:
        http.append({"name": "idempotent", "match": [{"method": {"exact": m}} for m in methods],
                     "route": destination, "timeout": IDEMPOTENT_TIMEOUT, "retries": RETRY})
    http.append({"name": "other", "route": destination, "retries": no_retry})
    return {"apiVersion": ISTIO_NETWORKING, "kind": "VirtualService", "metadata": meta(name_of(service), service),
            "spec": {"hosts": [name_of(service)], "http": http}}


def data_plane_policy() -> dict[str, Any]:
    """Engine pods: the data port from engine pods only; the control port and the mesh's own ports
    from anywhere (the mesh's policies above decide who, by identity)."""
    engines = {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "engine"}}}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": meta(f"{name_of('engine')}-data-plane", "engine"),
            "spec": {"podSelector": {"matchLabels": {"app.kubernetes.io/component": "engine"}},
                     "policyTypes": ["Ingress"],
                     "ingress": [{"from": [engines], "ports": [{"protocol": "TCP", "port": "kv-data"}]},
                                 {"ports": [{"protocol": "TCP", "port": "http"},
                                            *({"protocol": "TCP", "port": p} for p in MESH_PORTS)]}]}}


def mesh_documents(cluster: Cluster, routes: dict[str, list[tuple[str, str]]]) -> list[dict[str, Any]]:
    docs = [peer_authentication(), allow_nothing(), *(allow(component, None) for component in PUBLIC)]
    docs += [allow(component, callers) for component, callers in CALLERS.items()]
    for service in ("kvmeta", "predictor", "scheduler", "admission"):
        docs += [destination_rule(service), virtual_service(cluster, service, routes[service])]
    return docs

