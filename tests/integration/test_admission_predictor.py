"""Admission with the predictor service (CacheOpt): each request is predicted before it runs, the
estimated length reaches the engine, and its actual length goes back to the predictor; a predictor
that is down costs the request nothing. Real processes on loopback."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import openai
import pytest

from ..conftest import cluster_name
from .admission_fixtures import MODEL, launch, ready, start_cluster, wait_until_idle

KEY = "sk-predictor-test"


@pytest.fixture(scope="module")
def predicted(tmp_path_factory: pytest.TempPathFactory, redis_url: str, request: pytest.FixtureRequest):
    run_dir = tmp_path_factory.mktemp("predicted")
    with ExitStack() as exits:
        predictor = ready(exits, launch("predictor", run_dir, KVMESH_PREDICTOR_ADAPTIVE="false"))
        cluster = start_cluster(exits, run_dir, redis_url, cluster_name(request), {"engine-0": "both"},
                                every_env={"KVMESH_TRACE_FILE": str(run_dir / "spans.jsonl")},
                                KVMESH_API_KEY=KEY, KVMESH_ADMISSION_PREDICTOR_URL=predictor.url)
        yield cluster, predictor, run_dir / "spans.jsonl"


def counter(url: str, name: str) -> float:
    body = urllib.request.urlopen(url + "/metrics").read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name + "{"))


async def eventually(check, timeout: float = 10.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while not (result := await asyncio.to_thread(check)) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.2)
    return result


def engine_spans(path: Path) -> list[dict]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [span for span in map(json.loads, lines) if span["name"] == "POST /v1/generate"]


async def test_requests_are_predicted_and_observed(predicted):
    cluster, predictor, spans = predicted
    async with openai.AsyncOpenAI(base_url=cluster.admission.url + "/v1", api_key=KEY, max_retries=0) as client:
        for _ in range(3):
            await client.completions.create(model=MODEL, prompt="count to five", max_tokens=5,
                                            extra_body={"ignore_eos": True})
    assert counter(predictor.url, "kvmesh_predictor_predictions_total") == 3
    assert await eventually(lambda: counter(predictor.url, "kvmesh_predictor_observations_total") == 3)
    # after two requests of exactly 5 tokens, the history predicts 5 with no spread: the engine is told 5
    found = await eventually(lambda: len(engine_spans(spans)) == 3 and engine_spans(spans))
    assert [s["attributes"].get("kvmesh.predicted_output_len") for s in found][-1] == 5
    for engine in cluster.engines.values():
        state = await wait_until_idle(engine.url)
        assert state["free_blocks"] == state["total_blocks"]


async def test_a_predictor_that_is_down_costs_the_request_nothing(predicted):
    cluster, predictor, _ = predicted
    predictor.stop()
    async with openai.AsyncOpenAI(base_url=cluster.admission.url + "/v1", api_key=KEY, max_retries=0) as client:
        reply = await client.completions.create(model=MODEL, prompt="still answered", max_tokens=3)
    assert reply.usage.completion_tokens == 3
