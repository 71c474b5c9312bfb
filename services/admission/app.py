"""Admission: the public, OpenAI-compatible front door (docs/serving.md).

`POST /v1/completions`, `POST /v1/chat/completions` (server-sent events when `stream`), `GET /v1/models`
(openai_routes.py: each request's checks in order, then its journey through the cluster, lifecycle.py).
`GET`/`PUT /v1/upstreams` swap the scheduler or the length predictor for another service speaking the
same API while requests flow (control_routes.py). This module wires the routes to their handlers.
"""

from __future__ import annotations

from kvmesh.libs.controlplane import Service
from kvmesh.libs.controlplane.codec import JSON

from .config import Config
from .control_routes import ControlRoutes
from .engine_client import EngineClients
from .openai_api import ChatCompletionRequest, CompletionRequest
from .openai_routes import OpenAIRoutes
from .tokenizers import Models
from .upstreams import UpstreamChange, Upstreams, UpstreamSettings

OPENAI = (JSON,)  # the OpenAI routes read and answer JSON only, errors in OpenAI's shape included


def build_service(config: Config) -> Service:
    service = Service("admission", config)
    upstreams = Upstreams(config.scheduler_url, config.predictor_url, config.token, config.route_timeout_s,
                          config.predict_timeout_s, service.metrics)
    engines = EngineClients(config.token, config.connect_timeout_s, abort_timeout_s=config.route_timeout_s)
    models = Models(upstreams, engines, config.models_refresh_s)
    control = ControlRoutes(upstreams, engines)
    openai = OpenAIRoutes(config, upstreams, engines, models, service.metrics)
    service.lifespan(control.clients)
    service.readiness(control.scheduler_answers)

    service.route("GET", "/v1/upstreams", response=UpstreamSettings)(control.get_upstreams)
    service.route("PUT", "/v1/upstreams", body=UpstreamChange, response=UpstreamSettings)(control.set_upstreams)
    service.route("POST", "/v1/completions", internal=False, span_name="admission", media=OPENAI,
                  reads=CompletionRequest)(openai.completions)
    service.route("POST", "/v1/chat/completions", internal=False, span_name="admission", media=OPENAI,
                  reads=ChatCompletionRequest)(openai.chat_completions)
    service.route("GET", "/v1/models", internal=False, media=OPENAI)(openai.list_models)
    service.route("GET", "/v1/models/{model:.+}", internal=False, media=OPENAI)(openai.get_model)
    return service
