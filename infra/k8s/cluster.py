"""kvmesh's configuration on Kubernetes, and everything the manifests derive from it.

One source of truth: the settings below are written out as each service's TOML file (mounted from a
ConfigMap), and then read back through the services' own `load_config` and Config structs. Every
port, URL and config key in the manifests comes from those loaded structs, never typed twice, so a
default changed in the code moves the manifests with it when they are generated again
(`python -m kvmesh.infra.k8s.generate`), and a test fails until they are.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import tomli_w

from kvmesh.libs.controlplane import ServiceConfig, load_config
from kvmesh.services.configs import config_class

NAMESPACE = "kvmesh"
SERVICES = ("kvmeta", "predictor", "scheduler", "engine", "admission")  # every kvmesh service, in start order
ENGINE_ROLES = ("prefill", "decode")  # one StatefulSet each: a stable identity per engine for registration
CONFIG_DIR = "/etc/kvmesh"            # each pod's TOML file, from its service's ConfigMap
SECRET = "kvmesh-secrets"  # keys: token, api-keys (a JSON list); made by the operator (cpu-dev generates one)
REDIS = "kvmesh-redis"
REDIS_PORT = 6379
SENTINEL_PORT = 26379
REDIS_REPLICAS = 3                    # one master, two replicas; a Sentinel beside each (quorum 2)
OTLP_HTTP_PORT = 4318


def name_of(service: str) -> str:
    """The Kubernetes name of a service's workload, Service, ServiceAccount and ConfigMap prefix."""
    return f"kvmesh-{service}"


def url_of(service: str, port: int) -> str:
    return f"http://{name_of(service)}:{port}"


@dataclass(frozen=True)
class Settings:
    """One deployment's settings: the shared keys and each service's table (the TOML layout)."""

    shared: dict[str, Any]
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)

    def document(self, service: str) -> dict[str, Any]:
        """What `service`'s TOML file holds: the shared keys and its own table only, so that a change
        to one service's settings rolls only that service's pods."""
        table = self.tables.get(service, {})
        return {**self.shared, service: table} if table else dict(self.shared)

    def toml(self, service: str) -> str:
        return tomli_w.dumps(self.document(service))

    def merged(self, shared: dict[str, Any] | None = None, **tables: dict[str, Any]) -> Settings:
        return Settings({**self.shared, **(shared or {})},
                        {s: {**self.tables.get(s, {}), **tables.get(s, {})} for s in {*self.tables, *tables}})

    def config(self, service: str) -> ServiceConfig:
        """The service's config as the service itself reads it from this file (no environment)."""
        cls = config_class(service)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "kvmesh.toml"
            path.write_text(self.toml(service))
            return load_config(cls, service, path, env={})


def base_settings() -> Settings:
    """The base deployment: every service listens on all interfaces and finds the others by their
    Kubernetes Service names, at the ports the others' own configs give."""
    shared = {"host": "0.0.0.0", "cluster": NAMESPACE, "log_format": "json",
              "otlp_endpoint": f"http://kvmesh-otel-collector:{OTLP_HTTP_PORT}", "trace_sample": 0.1}
    settings = Settings(shared, {
        "kvmeta": {"redis_sentinels": [f"{REDIS}-{i}.{REDIS}:{SENTINEL_PORT}" for i in range(REDIS_REPLICAS)],
                   "redis_master": NAMESPACE},
        # A fixed data-plane port: a pod's ports are declared, and the mesh must be told to leave it alone.
        "engine": {"data_port": 8300},
    })
    ports = {s: settings.config(s).port for s in ("kvmeta", "predictor", "scheduler")}
    return settings.merged(
        scheduler={"kvmeta_url": url_of("kvmeta", ports["kvmeta"])},
        engine={"kvmeta_url": url_of("kvmeta", ports["kvmeta"])},
        admission={"scheduler_url": url_of("scheduler", ports["scheduler"]),
                   "predictor_url": url_of("predictor", ports["predictor"])})


# What each overlay changes; written to overlays/<name>/config/ and swapped in by its kustomization.
OVERLAY_SETTINGS: dict[str, dict[str, dict[str, Any]]] = {
    # A laptop or CI cluster (kind, minikube): the tiny random-initialised model on the CPU, all traced.
    "cpu-dev": {"shared": {"trace_sample": 1.0, "log_format": "text"},
                "engine": {"model": "tiny", "device_bytes": 64 * 2**20, "cxl_bytes": 128 * 2**20}},
    # GPU nodes with RDMA NICs: a real checkpoint from the models volume, KV over verbs.
    "gpu-rdma": {"engine": {"model": "/models/current", "device": "cuda", "dtype": "bfloat16",
                            "device_bytes": 40 * 2**30, "cxl_bytes": 128 * 2**30, "max_num_seqs": 256,
                            "token_budget": 8192, "dataplane": "verbs",
                            # the VF Multus gives the pod (engine-gpu-rdma.yaml names it net1): the data plane
                            # listens on its address and opens its RDMA device, GID from its IPv4 address
                            "data_interface": "net1", "rdma_device": "auto"}},
}


@dataclass(frozen=True)
class Replacement:
    """Another implementation of a policy service's API, deployed beside the builtin one on an
    overlay (infra/k8s/examples/swap-<service>: switching the Service's selector swaps them)."""

    overlay: str
    service: str
    implementation: str
    table: dict[str, Any]

    def settings(self) -> Settings:
        return overlay_settings(self.overlay).merged(**{self.service: self.table})


# The builtin predictor configured as RLP (prediction + fixed padding) stands in for "another
# Deployment that speaks the same REST API": any program serving docs/api/predictor.openapi.json does.
SWAP_EXAMPLE = Replacement("cpu-dev", "predictor", "rlp", {"predictor": "rlp"})


def overlay_settings(overlay: str) -> Settings:
    changes = OVERLAY_SETTINGS[overlay]
    return base_settings().merged(changes.get("shared"), **{k: v for k, v in changes.items() if k != "shared"})


@dataclass(frozen=True)
class Ports:
    """The ports of one service, from its loaded config."""

    http: int
    data: int | None = None  # engines: the KV data plane, which bypasses the mesh


class Cluster:
    """The loaded configs of one deployment, for the manifest builders."""

    def __init__(self, settings: Settings):
        self.settings = settings

    @cached_property
    def configs(self) -> dict[str, ServiceConfig]:
        return {s: self.settings.config(s) for s in SERVICES}

    def ports(self, service: str) -> Ports:
        config = self.configs[service]
        return Ports(config.port, getattr(config, "data_port", None) or None)
