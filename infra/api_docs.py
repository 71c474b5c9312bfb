"""Every service's OpenAPI description, as the service serves it at `GET /openapi.json`.

`python -m kvmesh.infra.k8s.generate` writes them to docs/api/ (the REST API a replacement policy
service must speak), and the mesh's routes (infra/k8s/mesh.py) are derived from the same tables.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvmesh.libs.controlplane import load_config
from kvmesh.libs.controlplane.openapi import openapi_document

# Building a service needs a token for its secured routes to be described as such; an engine builds
# its (tiny, default) model, and needs no data plane for its routes to be listed.
_BUILD_ENV = {"KVMESH_TOKEN": "openapi", "KVMESH_ENGINE_DATAPLANE": "none", "KVMESH_ADMISSION_API_KEY": "openapi"}


def service_openapi(service: str) -> dict[str, Any]:
    module = importlib.import_module(f"kvmesh.services.{service}.app")
    config = load_config(module.Config, service, None, env=_BUILD_ENV)
    built = module.build_service(config)
    return openapi_document(service, built.routes, secured=True)


def operations(document: dict[str, Any]) -> list[tuple[str, str]]:
    """(METHOD, path) of every route the document describes."""
    return [(method.upper(), path) for path, methods in document["paths"].items() for method in methods]
