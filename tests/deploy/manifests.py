"""Reading rendered manifests: workloads, the kvmesh containers in them, their env as a pod would see it."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

WORKLOAD_KINDS = ("Deployment", "StatefulSet")
# What the kubelet would put into env vars that come from the pod or a Secret (docs/deploy.md).
FIELD_SAMPLES = {"metadata.name": "kvmesh-engine-prefill-0", "metadata.namespace": "kvmesh", "status.podIP": "10.1.2.3"}
SECRET_SAMPLES = {"token": "cluster-token", "api-keys": '["key-1", "key-2"]'}
CPU_SAMPLE = "2"


@dataclass(frozen=True)
class KvmeshContainer:
    service: str
    container: dict[str, Any]
    pod: dict[str, Any]        # the pod template
    workload: dict[str, Any]

    @property
    def ports(self) -> dict[str, int]:
        return {p["name"]: p["containerPort"] for p in self.container.get("ports", [])}


def by_kind(documents: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in documents if d["kind"] == kind]


def named(documents: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [d for d in by_kind(documents, kind) if d["metadata"]["name"] == name]
    assert found, f"no {kind} {name}"
    return found[0]


def pod_templates(documents: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for workload in documents:
        if workload["kind"] in WORKLOAD_KINDS:
            yield workload, workload["spec"]["template"]


def kvmesh_containers(documents: list[dict[str, Any]]) -> list[KvmeshContainer]:
    return [KvmeshContainer(c["command"][2], c, pod, workload)
            for workload, pod in pod_templates(documents) for c in pod["spec"]["containers"]
            if c.get("command", [])[:2] == ["kvmesh", "serve"]]


def selects(selector: dict[str, str], pod: dict[str, Any]) -> bool:
    labels = pod["metadata"].get("labels", {})
    return all(labels.get(k) == v for k, v in selector.items())


def env_of(container: dict[str, Any]) -> dict[str, str]:
    """The container's env as the process would see it, with pod fields and secrets sampled."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            value = entry["value"]
        elif "fieldRef" in entry["valueFrom"]:
            value = FIELD_SAMPLES[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in entry["valueFrom"]:
            value = SECRET_SAMPLES[entry["valueFrom"]["secretKeyRef"]["key"]]
        else:
            assert "resourceFieldRef" in entry["valueFrom"], entry
            value = CPU_SAMPLE
        # $(NAME) refers to an env var defined earlier in the list, as the kubelet expands it.
        env[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], value)
    return env


def mounted_config_map(item: KvmeshContainer, mount_path: str) -> str:
    mount = next(m for m in item.container["volumeMounts"] if m["mountPath"] == mount_path)
    volume = next(v for v in item.pod["spec"]["volumes"] if v["name"] == mount["name"])
    return volume["configMap"]["name"]
