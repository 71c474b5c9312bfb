"""The OpenAPI description a service serves: what a client generator (or schemathesis) reads."""

from __future__ import annotations

from aiohttp import web

from kvmesh.infra.api_docs import service_openapi
from kvmesh.libs.controlplane import Service, ServiceConfig
from kvmesh.libs.controlplane.codec import JSON, MSGPACK
from kvmesh.libs.controlplane.openapi import openapi_document


def document() -> dict:
    service = Service("probe", ServiceConfig(port=1, token="t"))

    @service.route("GET", "/v1/things/{name:.+}", internal=False, media=(JSON,))
    async def thing(request: web.Request) -> web.Response:
        """One thing, by a name that may hold slashes."""
        return web.json_response({})

    return openapi_document(service.name, service.routes, secured=True)


def test_a_path_pattern_is_described_as_an_openapi_template_with_its_parameter():
    paths = document()["paths"]
    assert "/v1/things/{name}" in paths and not any(":" in path for path in paths)
    parameters = paths["/v1/things/{name}"]["get"]["parameters"]
    assert parameters == [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}]


def test_a_route_describes_only_the_media_it_answers_in():
    paths = document()["paths"]
    assert set(paths["/v1/things/{name}"]["get"]["responses"]["default"]["content"]) == {JSON}
    assert set(paths["/health"]["get"]["responses"]["200"]["content"]) == {JSON, MSGPACK}


def test_admission_describes_its_openai_routes_as_json_with_their_path_parameters():
    paths = service_openapi("admission")["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}"):
        for operation in paths[path].values():
            assert set(operation["responses"]["default"]["content"]) == {JSON}, path
    assert paths["/v1/models/{model}"]["get"]["parameters"][0]["name"] == "model"
