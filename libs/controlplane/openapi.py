"""OpenAPI 3.1 description of a service, generated from its route table and msgspec structs."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import msgspec

from .errors import ErrorBody

if TYPE_CHECKING:
    from .service import Route

_REF = "#/components/schemas/{name}"
_TEMPLATE_PATTERN = re.compile(r"\{(\w+):[^}]*\}")
_TEMPLATE_NAME = re.compile(r"\{(\w+)\}")


def openapi_document(service: str, routes: list[Route], secured: bool) -> dict[str, Any]:
    types = sorted({t for r in routes for t in (r.body or r.reads, r.query, r.params, r.response) if t is not None}
                   | {ErrorBody}, key=repr)
    schemas, components = msgspec.json.schema_components(types, ref_template=_REF)
    schema_of = dict(zip(types, schemas))
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        path = _TEMPLATE_PATTERN.sub(r"{\1}", route.path)  # aiohttp's `{name:regex}` is OpenAPI's `{name}`
        media = lambda schema: {kind: {"schema": schema} for kind in route.media}  # noqa: E731
        operation: dict[str, Any] = {
            "summary": route.summary,
            "operationId": f"{route.method.lower()}_{re.sub(r'[^a-z0-9]+', '_', path.lower()).strip('_')}",
            "responses": {"200": {"description": "success"},
                          "default": {"description": "error", "content": media(schema_of[ErrorBody])}},
        }
        if route.response is not None:
            operation["responses"]["200"]["content"] = media(schema_of[route.response])
        if (body := route.body or route.reads) is not None:
            operation["requestBody"] = {"required": True, "content": media(schema_of[body])}
        parameters = _parameters(route.params, "path", components) + _parameters(route.query, "query", components)
        declared = {p["name"] for p in parameters if p["in"] == "path"}
        parameters += [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                       for name in _TEMPLATE_NAME.findall(path) if name not in declared]
        if parameters:
            operation["parameters"] = parameters
        if route.internal and secured:
            operation["security"] = [{"serviceToken": []}]
        paths.setdefault(path, {})[route.method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": f"kvmesh {service}", "version": "1"},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"serviceToken": {"type": "http", "scheme": "bearer"}}},
    }


def _parameters(struct: type | None, where: str, components: dict[str, Any]) -> list[dict[str, Any]]:
    if struct is None:
        return []
    schema = components[struct.__name__]
    required = set(schema.get("required", ()))
    return [{"name": name, "in": where, "required": where == "path" or name in required, "schema": prop}
            for name, prop in schema.get("properties", {}).items()]
