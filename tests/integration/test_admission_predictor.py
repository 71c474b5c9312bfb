"""Admission with the predictor service (CacheOpt): each request is predicted before it runs, the
estimated length reaches the engine, and its actual length goes back to the predictor; the prompt
goes as text when the request had text (the `embedding` predictor, serving a trained model, answers
from it and learns from it), cut to the predictor's limits; a predictor that is down costs the request
nothing. Real processes on loopback."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import openai
import pytest

from kvmesh.libs.controlplane import ServiceClient
from kvmesh.libs.messages.predictor import MAX_PROMPT_CHARS, MAX_PROMPT_TOKENS
from kvmesh.services.admission.predictor_client import PredictorClient

from ..conftest import TOKEN, cluster_name
from ..polling import eventually
from . import test_predictor_embedding as embedding_tests
from .admission_fixtures import MODEL, launch, ready, start_cluster, wait_until_idle
from .test_predictor import metrics_text, samples
from .test_predictor_embedding import ENV as EMBEDDING_ENV
from .test_predictor_embedding import LONG, SHORT, UNSEEN

KEY = "sk-predictor-test"
trained = embedding_tests.trained  # the fixture: `kvmesh predictor train` on 300 examples, once a session


@pytest.fixture(scope="module")
def predicted(tmp_path_factory: pytest.TempPathFactory, redis_url: str, request: pytest.FixtureRequest):
    run_dir = tmp_path_factory.mktemp("predicted")
    with ExitStack() as exits:
        predictor = ready(exits, launch("predictor", run_dir, KVMESH_PREDICTOR_ADAPTIVE="false"))
        cluster = start_cluster(exits, run_dir, redis_url, cluster_name(request), {"engine-0": "both"},
                                every_env={"KVMESH_TRACE_FILE": str(run_dir / "spans.jsonl")},
                                KVMESH_API_KEY=KEY, KVMESH_ADMISSION_PREDICTOR_URL=predictor.url)
        yield cluster, predictor, run_dir / "spans.jsonl"


@pytest.fixture(scope="module")
def embedded(predicted, trained, tmp_path_factory: pytest.TempPathFactory):
    """A second admission in front of the same cluster, whose predictor serves the trained model with
    `embedding` in force (c fixed at 0.9); its spans go to a file of its own."""
    cluster, _, _ = predicted
    run_dir = tmp_path_factory.mktemp("embedded")
    with ExitStack() as exits:
        predictor = ready(exits, launch("predictor", run_dir, **EMBEDDING_ENV,
                                        KVMESH_PREDICTOR_MODEL_PATH=str(trained[0])))
        admission = ready(exits, launch("admission", run_dir, KVMESH_SCHEDULER_URL=cluster.scheduler.url,
                                        KVMESH_API_KEY=KEY, KVMESH_ADMISSION_PREDICTOR_URL=predictor.url,
                                        KVMESH_TRACE_FILE=str(run_dir / "spans.jsonl")))
        yield admission, predictor, run_dir / "spans.jsonl"


def counter(url: str, name: str) -> float:
    body = urllib.request.urlopen(url + "/metrics").read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name + "{"))


async def eventually_true(check):
    """`check()`, run off the event loop (it reads files and blocking HTTP), once it is truthy."""
    return await eventually(lambda: asyncio.to_thread(check), bool, interval=0.2)


def spans_named(path: Path, name: str) -> list[dict]:
    lines = path.read_text().splitlines() if path.exists() else []
    return [span for span in map(json.loads, lines) if span["name"] == name]


def engine_spans(path: Path) -> list[dict]:
    return spans_named(path, "POST /v1/generate")


async def embedding_counts(url: str) -> tuple[float, float]:
    """(observations under `embedding`, observed prompts `embedding` keeps): only a prompt text adds to
    the second."""
    observed = await samples(url, "kvmesh_predictor_observations")
    kept = await samples(url, "kvmesh_predictor_embedding_examples")
    return (observed[("kvmesh_predictor_observations_total", (("predictor", "embedding"),))],
            kept[("kvmesh_predictor_embedding_examples", ())])


async def test_requests_are_predicted_and_observed(predicted):
    cluster, predictor, spans = predicted
    async with openai.AsyncOpenAI(base_url=cluster.admission.url + "/v1", api_key=KEY, max_retries=0) as client:
        for _ in range(3):
            await client.completions.create(model=MODEL, prompt="count to five", max_tokens=5,
                                            extra_body={"ignore_eos": True})
    assert counter(predictor.url, "kvmesh_predictor_predictions_total") == 3
    assert await eventually_true(lambda: counter(predictor.url, "kvmesh_predictor_observations_total") == 3)
    # after two requests of exactly 5 tokens, the history predicts 5 with no spread: the engine is told 5
    found = await eventually_true(lambda: len(engine_spans(spans)) == 3 and engine_spans(spans))
    assert [s["attributes"].get("kvmesh.predicted_output_len") for s in found][-1] == 5
    # ... and the range around it, for LayerKV: no spread, so its lower bound and median are 5 too
    assert {name: found[-1]["attributes"].get(f"kvmesh.predicted_output_{name}") for name in ("low", "median")} == \
        {"low": 5, "median": 5}
    for engine in cluster.engines.values():
        state = await wait_until_idle(engine.url)
        assert state["free_blocks"] == state["total_blocks"]


async def test_the_predictor_gets_the_prompt_text_and_learns_from_it(embedded):
    admission, predictor, spans = embedded
    short, long = SHORT[0].format(UNSEEN[0]), LONG[0].format(UNSEEN[0])
    system = "You are a helpful assistant."
    # what `embedding` answers for each text; a one-message chat reads as its message, a longer one as
    # its messages' contents one a line
    texts = [long, short, long, f"{system}\n{short}"]
    async with ServiceClient(predictor.url, token=TOKEN) as direct:
        expected = [(await direct.call("POST", "/v1/predict", {"prompt": text, "max_tokens": 4, "tenant": MODEL},
                                       into=dict))["predicted"] for text in texts]
    assert expected[1] * 4 < expected[0]  # the model tells the wordings apart (20 vs 600 tokens typical)
    before = await embedding_counts(predictor.url)
    async with openai.AsyncOpenAI(base_url=admission.url + "/v1", api_key=KEY, max_retries=0) as client:
        for prompt in (long, short):
            await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True})
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long}],
                                             max_tokens=4, extra_body={"ignore_eos": True})
        await client.chat.completions.create(model=MODEL, max_tokens=4, extra_body={"ignore_eos": True},
                                             messages=[{"role": "system", "content": system},
                                                       {"role": "user", "content": short}])
        # token ids alone go as ids: `embedding` falls back to the history, which has seen 4-token answers
        await client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4,
                                        extra_body={"ignore_eos": True})
    found = await eventually_true(lambda: len(spans_named(spans, "predict")) == 5 and spans_named(spans, "predict"))
    assert found, "admission left no predict span per request"
    predicted = [span["attributes"]["kvmesh.predicted"] for span in found]
    assert predicted[:4] == expected
    assert predicted[4] == 4
    # /v1/observe carried the four texts (kept for the refits) and not the ids
    for _ in range(50):  # the observations go in the background, after each answer
        if (await embedding_counts(predictor.url))[0] == before[0] + 5:
            break
        await asyncio.sleep(0.2)
    assert await embedding_counts(predictor.url) == (before[0] + 5, before[1] + 4)


async def test_a_prompt_over_the_predictors_limits_is_cut_not_refused(embedded):
    _, predictor, _ = embedded
    before = await embedding_counts(predictor.url)
    client = PredictorClient(predictor.url, TOKEN, timeout_s=60)
    try:
        text = "essay " * (MAX_PROMPT_CHARS // 6 + 100)  # longer than the predictor takes
        assert len(text) > MAX_PROMPT_CHARS
        by_text = await client.predict([1], 8, "t", text)
        assert by_text is not None and by_text.estimated <= 8
        by_ids = await client.predict([1] * (MAX_PROMPT_TOKENS + 1), 8, "nobody")
        assert by_ids is not None and by_ids.predicted == 8  # the history, knowing nothing of "nobody"
        client.observe("t", MAX_PROMPT_TOKENS, 3, by_text, text)
    finally:
        await client.close()  # waits for the observation
    assert await embedding_counts(predictor.url) == (before[0] + 1, before[1] + 1)
    assert 'status="400"' not in await metrics_text(predictor.url)


async def test_a_predictor_that_is_down_costs_the_request_nothing(predicted):
    cluster, predictor, _ = predicted
    predictor.stop()
    async with openai.AsyncOpenAI(base_url=cluster.admission.url + "/v1", api_key=KEY, max_retries=0) as client:
        reply = await client.completions.create(model=MODEL, prompt="still answered", max_tokens=3)
    assert reply.usage.completion_tokens == 3
