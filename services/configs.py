"""Each service's configuration class, found without importing what serving it needs: the engine's
app imports torch and the model code, 6 s that every `kvmesh up` waited for before its engines."""

from __future__ import annotations

import importlib

from kvmesh.libs.controlplane import ServiceConfig


def config_class(service: str) -> type[ServiceConfig]:
    """`Config` of kvmesh.services.SERVICE.config where the service has that module, else of its app."""
    package = f"kvmesh.services.{service}"
    try:
        return importlib.import_module(f"{package}.config").Config
    except ModuleNotFoundError as exc:
        if exc.name != f"{package}.config":
            raise
    return importlib.import_module(f"{package}.app").Config
