"""A length predictor written outside kvmesh: what a team swapping in its own policy service writes.

It speaks the predictor API of docs/api/predictor.openapi.json with nothing from kvmesh (aiohttp,
msgpack and prometheus-client only): `POST /v1/predict`, `POST /v1/observe`, `GET /health`,
`GET /ready`, `GET /metrics` and `GET /openapi.json` (admission checks `/ready` and that the API lists
the operations it calls before it swaps a service in). Its prediction is
the prompt's length times the ratio of output to prompt seen so far, per tenant (a running mean over
observed requests), padded by the observed spread of that ratio.

    python examples/policy_services/ratio_predictor.py --port 8200
    kvmesh swap predictor http://127.0.0.1:8200

Bodies come as msgpack (kvmesh's services) or JSON (curl); answers follow the Accept header. With
KVMESH_TOKEN set, calls must carry it as a bearer token, as kvmesh's own services require.
"""

from __future__ import annotations

import argparse
import hmac
import json
import math
import os
from dataclasses import dataclass

import msgpack
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

MSGPACK = "application/msgpack"
CHARS_PER_TOKEN = 4      # a prompt that comes as text: its length in tokens, roughly
PRIOR_RATIO, PRIOR_WEIGHT = 1.0, 1.0  # before any observation: output as long as the prompt


@dataclass
class Ratio:
    """Welford's running mean and variance of output/prompt lengths."""

    count: float = PRIOR_WEIGHT
    mean: float = PRIOR_RATIO
    m2: float = 0.0

    def add(self, value: float) -> None:
        self.count += 1
        delta = value - self.mean
        self.mean += delta / self.count
        self.m2 += delta * (value - self.mean)

    @property
    def spread(self) -> float:
        return math.sqrt(self.m2 / self.count)


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def decode(request: web.Request, raw: bytes) -> dict:
    try:
        body = msgpack.unpackb(raw) if request.content_type == MSGPACK else json.loads(raw)
    except ValueError as exc:
        raise HttpError(400, f"malformed body: {exc}") from None
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be an object")
    return body


def answer(request: web.Request, body: object, status: int = 200) -> web.Response:
    if MSGPACK in request.headers.get("Accept", ""):
        return web.Response(status=status, body=msgpack.packb(body), content_type=MSGPACK)
    return web.json_response(body, status=status)


def positive_int(body: dict, name: str, default: int | None = None) -> int:
    value = body.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "actual" else 1):
        raise HttpError(400, f"{name} must be a positive integer, got {value!r}")
    return value


def prompt_tokens(body: dict) -> int:
    if isinstance(body.get("prompt_token_ids"), list) and body["prompt_token_ids"]:
        return len(body["prompt_token_ids"])
    if isinstance(body.get("prompt"), str) and body["prompt"]:
        return max(1, len(body["prompt"]) // CHARS_PER_TOKEN)
    raise HttpError(400, "give the prompt as a non-empty `prompt` or `prompt_token_ids`")


OPENAPI = {"openapi": "3.1.0", "info": {"title": "ratio predictor", "version": "1"},
           "paths": {"/v1/predict": {"post": {}}, "/v1/observe": {"post": {}}, "/health": {"get": {}},
                     "/ready": {"get": {}}, "/metrics": {"get": {}}, "/openapi.json": {"get": {}}}}


def build_app(token: str | None) -> web.Application:
    ratios: dict[str, Ratio] = {}
    metrics = CollectorRegistry()
    predictions = Counter("ratio_predictor_predictions", "Lengths predicted", registry=metrics)
    observations = Counter("ratio_predictor_observations", "Actual lengths learned from", registry=metrics)

    @web.middleware
    async def errors_and_token(request: web.Request, handler) -> web.StreamResponse:
        try:
            if token and request.path.startswith("/v1/"):
                presented = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
                if not hmac.compare_digest(presented.encode(), token.encode()):
                    raise HttpError(401, "a valid service token is required")
            return await handler(request)
        except HttpError as exc:
            return answer(request, {"error": {"type": "invalid_request", "message": exc.message,
                                              "code": exc.status}}, exc.status)

    async def predict(request: web.Request) -> web.Response:
        body = decode(request, await request.read())
        cap = positive_int(body, "max_tokens")
        ratio = ratios.get(str(body.get("tenant", "default")), Ratio())
        predicted = max(1, min(cap, round(ratio.mean * prompt_tokens(body))))
        padding = ratio.spread * prompt_tokens(body)
        predictions.inc()
        return answer(request, {"predicted": predicted, "direction": "under", "padding": padding,
                                "estimated": max(1, min(cap, math.ceil(predicted + padding))),
                                "confidence": None, "predictor": "ratio"})

    async def observe(request: web.Request) -> web.Response:
        body = decode(request, await request.read())
        actual, prompt_len = positive_int(body, "actual"), positive_int(body, "prompt_len")
        ratios.setdefault(str(body.get("tenant", "default")), Ratio()).add(actual / prompt_len)
        observations.inc()
        return web.Response(status=204)

    async def alive(request: web.Request) -> web.Response:
        return answer(request, {"status": "ok", "service": "predictor"})

    async def openapi(request: web.Request) -> web.Response:
        return web.json_response(OPENAPI)

    async def prometheus(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(metrics), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(middlewares=[errors_and_token])
    app.add_routes([web.post("/v1/predict", predict), web.post("/v1/observe", observe), web.get("/health", alive),
                    web.get("/ready", alive), web.get("/metrics", prometheus), web.get("/openapi.json", openapi)])
    return app


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200)
    args = parser.parse_args()
    web.run_app(build_app(os.environ.get("KVMESH_TOKEN")), host=args.host, port=args.port, print=None)
