"""Choosing a backend by name: `tcp` (software RDMA over sockets), `shm` (same host), `verbs` (a NIC)."""

from __future__ import annotations

import importlib

from .endpoint import Endpoint

BACKENDS = {
    "tcp": "kvmesh.libs.rdma.tcp.endpoint:TcpEndpoint",
    "shm": "kvmesh.libs.rdma.shm.endpoint:ShmEndpoint",
    "verbs": "kvmesh.libs.rdma.verbs.endpoint:VerbsEndpoint",
}


def endpoint_class(backend: str) -> type[Endpoint]:
    if backend not in BACKENDS:
        raise ValueError(f"no data-plane backend {backend!r}; there are: {', '.join(BACKENDS)}")
    module, name = BACKENDS[backend].split(":")
    return getattr(importlib.import_module(module), name)


def open_endpoint(backend: str, token: str, host: str = "127.0.0.1", port: int = 0, **options) -> Endpoint:
    return endpoint_class(backend)(token, host=host, port=port, **options)


def unavailable_reason(backend: str) -> str | None:
    """None when the backend can run here, else why not (no device, library missing, ...)."""
    return endpoint_class(backend).unavailable_reason()
