"""OpenAPI 3.1 description of a service, generated from its route table and msgspec structs."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import msgspec

from .codec import JSON, MSGPACK
from .errors import ErrorBody

if TYPE_CHECKING:
    from .service import Route

_REF = "#/components/schemas/{name}"


def openapi_document(service: str, routes: list[Route], secured: bool) -> dict[str, Any]:
    types = sorted({t for r in routes for t in (r.body, r.query, r.params, r.response) if t is not None} | {ErrorBody},
                   key=repr)
    schemas, components = msgspec.json.schema_components(types, ref_template=_REF)
    schema_of = dict(zip(types, schemas))
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        operation: dict[str, Any] = {
            "summary": route.summary,
            "operationId": f"{route.method.lower()}_{re.sub(r'[^a-z0-9]+', '_', route.path.lower()).strip('_')}",
            "responses": {"200": {"description": "success"},
                          "default": {"description": "error", "content": _media(schema_of[ErrorBody])}},
        }
        if route.response is not None:
            operation["responses"]["200"]["content"] = _media(schema_of[route.response])
        if route.body is not None:
            operation["requestBody"] = {"required": True, "content": _media(schema_of[route.body])}
        parameters = _parameters(route.params, "path", components) + _parameters(route.query, "query", components)
        if parameters:
            operation["parameters"] = parameters
        if route.internal and secured:
            operation["security"] = [{"serviceToken": []}]
        paths.setdefault(route.path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": f"kvmesh {service}", "version": "1"},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"serviceToken": {"type": "http", "scheme": "bearer"}}},
    }


def _media(schema: dict[str, Any]) -> dict[str, Any]:
    return {JSON: {"schema": schema}, MSGPACK: {"schema": schema}}


def _parameters(struct: type | None, where: str, components: dict[str, Any]) -> list[dict[str, Any]]:
    if struct is None:
        return []
    schema = components[struct.__name__]
    required = set(schema.get("required", ()))
    return [{"name": name, "in": where, "required": where == "path" or name in required, "schema": prop}
            for name, prop in schema.get("properties", {}).items()]
