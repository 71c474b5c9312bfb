"""Traces and metrics on Kubernetes (docs/observability.md): an OpenTelemetry Collector that every
service exports spans to (their `otlp_endpoint`), Jaeger behind it, Prometheus scraping every pod
that asks to be scraped, and Grafana with kvmesh's dashboards from observability/dashboards/.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from .cluster import NAMESPACE, OTLP_HTTP_PORT, SECRET, name_of
from .workloads import labels, meta

DASHBOARDS = Path(__file__).resolve().parents[2] / "observability" / "dashboards"
IMAGES = {"otel-collector": "otel/opentelemetry-collector-contrib:0.116.1", "jaeger": "jaegertracing/all-in-one:1.64.0",
          "prometheus": "prom/prometheus:v3.0.1", "grafana": "grafana/grafana:11.4.0"}
OTLP_GRPC_PORT = 4317
PORTS = {"otel-collector": OTLP_HTTP_PORT, "jaeger": 16686, "prometheus": 9090, "grafana": 3000}
COLLECTOR_METRICS_PORT = 8888
SCRAPE_INTERVAL = "15s"

COLLECTOR_CONFIG = {
    "receivers": {"otlp": {"protocols": {"http": {"endpoint": f"0.0.0.0:{OTLP_HTTP_PORT}"},
                                         "grpc": {"endpoint": f"0.0.0.0:{OTLP_GRPC_PORT}"}}}},
    "processors": {"memory_limiter": {"check_interval": "1s", "limit_percentage": 80, "spike_limit_percentage": 20},
                   "batch": {}},
    "exporters": {"otlp/jaeger": {"endpoint": f"{name_of('jaeger')}:{OTLP_GRPC_PORT}", "tls": {"insecure": True}}},
    "service": {"pipelines": {"traces": {"receivers": ["otlp"], "processors": ["memory_limiter", "batch"],
                                         "exporters": ["otlp/jaeger"]}}},
}


def _relabel(source: str, target: str, regex: str = "(.+)", replacement: str = "$1") -> dict[str, Any]:
    return {"source_labels": [source], "target_label": target, "regex": regex, "replacement": replacement}


# Every pod annotated prometheus.io/scrape (workloads.py), job = kvmesh-<component> as with `kvmesh up`.
PROMETHEUS_CONFIG = {
    "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
    "scrape_configs": [{
        "job_name": "kvmesh",
        "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": [NAMESPACE]}}],
        "relabel_configs": [
            {"source_labels": ["__meta_kubernetes_pod_annotation_prometheus_io_scrape"], "action": "keep", "regex": "true"},
            {"source_labels": ["__address__", "__meta_kubernetes_pod_annotation_prometheus_io_port"],
             "regex": r"([^:]+)(?::\d+)?;(\d+)", "replacement": "$1:$2", "target_label": "__address__"},
            _relabel("__meta_kubernetes_pod_annotation_prometheus_io_path", "__metrics_path__"),
            _relabel("__meta_kubernetes_pod_label_app_kubernetes_io_component", "job", replacement="kvmesh-$1"),
            _relabel("__meta_kubernetes_pod_name", "pod"),
        ],
    }],
}

GRAFANA_DATASOURCES = {"apiVersion": 1, "datasources": [
    {"name": "Prometheus", "type": "prometheus", "uid": "prometheus", "isDefault": True,
     "url": f"http://{name_of('prometheus')}:{PORTS['prometheus']}"},
    {"name": "Jaeger", "type": "jaeger", "uid": "jaeger", "url": f"http://{name_of('jaeger')}:{PORTS['jaeger']}"},
]}
GRAFANA_PROVIDERS = {"apiVersion": 1, "providers": [
    {"name": "kvmesh", "folder": "kvmesh", "type": "file", "options": {"path": "/var/lib/grafana/dashboards"}}]}


def _config_map(name: str, component: str, data: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(name, component), "data": data}


def _app(component: str, args: list[str], ports: list[tuple[str, int]], mounts: list[tuple[str, str, str]],
         env: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """ServiceAccount, Deployment and Service of one third-party component; mounts are (volume, ConfigMap, path)."""
    name = name_of(component)
    pod_labels = labels(component)
    container = {"name": component, "image": IMAGES[component], "args": args, "env": list(env),
                 "ports": [{"name": port_name, "containerPort": port} for port_name, port in ports],
                 "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}},
                 "volumeMounts": [{"name": volume, "mountPath": path} for volume, _, path in mounts]}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta(name, component)},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta(name, component),
         "spec": {"replicas": 1, "selector": {"matchLabels": pod_labels},
                  "template": {"metadata": {"labels": pod_labels},
                               "spec": {"serviceAccountName": name, "containers": [container],
                                        "volumes": [{"name": volume, "configMap": {"name": config_map}}
                                                    for volume, config_map, _ in mounts]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": meta(name, component),
         "spec": {"selector": pod_labels,
                  "ports": [{"name": port_name, "port": port, "targetPort": port_name} for port_name, port in ports]}},
    ]


def _prometheus_rbac() -> list[dict[str, Any]]:
    """Prometheus lists the namespace's pods to find what to scrape."""
    name = name_of("prometheus")
    return [
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta(name, "prometheus"),
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta(name, "prometheus"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": NAMESPACE}]},
    ]


def dashboards() -> dict[str, str]:
    """observability/dashboards/*.json, checked to be JSON, as one ConfigMap's data."""
    return {path.name: json.dumps(json.loads(path.read_text()), indent=1) + "\n"
            for path in sorted(DASHBOARDS.glob("*.json"))}


def observability_documents() -> list[dict[str, Any]]:
    as_yaml = lambda document: yaml.safe_dump(document, sort_keys=False)  # noqa: E731
    collector = name_of("otel-collector")
    return [
        _config_map(f"{collector}-config", "otel-collector", {"config.yaml": as_yaml(COLLECTOR_CONFIG)}),
        *_app("otel-collector", ["--config=/etc/otelcol/config.yaml"],
              [("http-otlp", OTLP_HTTP_PORT), ("grpc-otlp", OTLP_GRPC_PORT), ("http-metrics", COLLECTOR_METRICS_PORT)],
              [("config", f"{collector}-config", "/etc/otelcol")]),
        *_app("jaeger", [], [("http-query", PORTS["jaeger"]), ("grpc-otlp", OTLP_GRPC_PORT)], [],
              env=[{"name": "COLLECTOR_OTLP_ENABLED", "value": "true"}]),
        _config_map(f"{name_of('prometheus')}-config", "prometheus", {"prometheus.yml": as_yaml(PROMETHEUS_CONFIG)}),
        *_prometheus_rbac(),
        *_app("prometheus", ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.retention.time=7d"],
              [("http", PORTS["prometheus"])], [("config", f"{name_of('prometheus')}-config", "/etc/prometheus")]),
        _config_map(f"{name_of('grafana')}-datasources", "grafana", {"datasources.yaml": as_yaml(GRAFANA_DATASOURCES)}),
        _config_map(f"{name_of('grafana')}-providers", "grafana", {"dashboards.yaml": as_yaml(GRAFANA_PROVIDERS)}),
        _config_map(f"{name_of('grafana')}-dashboards", "grafana", dashboards()),
        *_app("grafana", [], [("http", PORTS["grafana"])],
              env=[{"name": "GF_SECURITY_ADMIN_PASSWORD", "valueFrom": {"secretKeyRef": {
                  "name": SECRET, "key": "grafana-admin-password", "optional": True}}}],
              mounts=[("datasources", f"{name_of('grafana')}-datasources", "/etc/grafana/provisioning/datasources"),
               ("providers", f"{name_of('grafana')}-providers", "/etc/grafana/provisioning/dashboards"),
               ("dashboards", f"{name_of('grafana')}-dashboards", "/var/lib/grafana/dashboards")]),
    ]

