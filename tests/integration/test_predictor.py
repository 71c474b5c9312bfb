"""The predictor as a real process: predictions learn from observed lengths, the confidence follows the
measured call rate (CacheOpt Eq. 4), the predictor switches at run time, bad input is a 4xx, and the
metrics count errors and under/over-provisioning exactly."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import aiohttp
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.infra.local.processes import Child
from kvmesh.libs.controlplane import ServiceClient, load_config
from kvmesh.policies.length import confidence_padding
from kvmesh.services.admission.app import Config as AdmissionConfig

from ..conftest import TOKEN
from .admission_fixtures import launch, ready

FIXED = {"KVMESH_PREDICTOR_ADAPTIVE": "false"}  # c = 0.9 whatever the rate, for exact paddings
PROMPT = {"prompt": "Summarise the cache paper", "max_tokens": 500, "tenant": "t"}


@pytest.fixture
def start_predictor(tmp_path: Path) -> Iterator[Callable[..., Child]]:
    """Start a predictor of the test's own with the given environment, ready; stopped after the test."""
    with ExitStack() as stack:
        yield lambda **env: ready(stack, launch("predictor", tmp_path, **env))


@pytest.fixture
async def client(start_predictor) -> AsyncIterator[ServiceClient]:
    async with ServiceClient(start_predictor(**FIXED).url, token=TOKEN) as c:
        yield c


async def predict(client: ServiceClient, **overrides) -> dict:
    return await client.call("POST", "/v1/predict", {**PROMPT, **overrides}, into=dict)


async def observe(client: ServiceClient, *actuals: int, **fields) -> None:
    for actual in actuals:
        await client.call("POST", "/v1/observe", {"tenant": "t", "actual": actual, **fields})


async def configure(client: ServiceClient, **change) -> dict:
    return await client.call("PUT", "/v1/config", change, into=dict)


async def test_a_prediction_reflects_the_observed_lengths(client):
    first = await predict(client)
    assert first == {"predicted": 500, "direction": "under", "padding": 0.0, "estimated": 500,
                     "confidence": 0.9, "predictor": "history"}  # no history: max_tokens, unpadded
    await observe(client, 100, 120)
    again = await predict(client)
    padding = confidence_padding(0.9, 120 - 100)  # Eq. 3 with (b - a) = 20: 21.46 tokens
    assert again == {"predicted": 110, "direction": "under", "padding": pytest.approx(padding),
                     "estimated": math.ceil(110 + padding), "confidence": 0.9, "predictor": "history"}
    assert (await predict(client, template="other"))["predicted"] == 500  # history is kept per template


async def test_the_confidence_falls_as_the_call_rate_rises(start_predictor):
    url = start_predictor(KVMESH_PREDICTOR_RATE_WINDOW_S="1", KVMESH_PREDICTOR_BETA="1000").url
    async with ServiceClient(url, token=TOKEN) as client:
        await observe(client, 100, 200)
        first = await predict(client)
        # one call: 1 req/s (1 / window), 0.001 req/ms
        assert first["confidence"] == pytest.approx(0.9 / (1 + 1000 * 0.001))
        burst = await asyncio.gather(*(predict(client) for _ in range(50)))
        assert max(p["confidence"] for p in burst) < first["confidence"]
        assert min(p["confidence"] for p in burst) < 0.9 / (1 + 20)  # over 20 req/s by the end
        assert min(p["padding"] for p in burst) < first["padding"]   # less confidence, less padding
        busy = (await client.call("GET", "/v1/config", into=dict))["arrival_rate"]
        await asyncio.sleep(2.0)  # two windows without calls: the rate falls by e^2
        assert (await client.call("GET", "/v1/config", into=dict))["arrival_rate"] < busy / 5


async def test_switching_to_rlp_and_s3_changes_the_answers_and_keeps_the_history(client):
    await observe(client, 100, 120)
    assert (await predict(client))["estimated"] == 132  # history: 110 + 21.46, rounded up
    assert (await configure(client, predictor="rlp"))["predictor"] == "rlp"
    assert await predict(client) == {"predicted": 110, "direction": "under", "padding": 100.0, "estimated": 210,
                                     "confidence": None, "predictor": "rlp"}  # + 100 tokens
    await configure(client, predictor="s3")
    assert await predict(client) == {"predicted": 110, "direction": "under", "padding": 40.0, "estimated": 150,
                                     "confidence": None, "predictor": "s3"}  # bucket [100, 150)
    await observe(client, 300)  # s3 learns into the same history: mean 173
    assert (await predict(client))["estimated"] == 200
    settings = await configure(client, predictor="history")
    assert settings["available"][:4] == ["history", "rlp", "s3", "oracle"]
    assert (await predict(client))["predicted"] == 173


async def test_the_oracle_answers_the_true_length_it_is_given(client):
    await configure(client, predictor="oracle")
    assert (await predict(client, true_length=77))["estimated"] == 77
    status, error = await raw(client.base_url, "POST", "/v1/predict", PROMPT)
    assert status == 400 and "true_length" in error["message"]


async def test_config_changes_are_validated_and_kept(client):
    assert await configure(client, alpha=0.5, beta=2.0, confidence=0.8, adaptive=True) == {
        "predictor": "history", "alpha": 0.5, "beta": 2.0, "confidence": 0.8, "adaptive": True,
        "rate_window_s": 10.0, "arrival_rate": 0.0, "available": ["history", "rlp", "s3", "oracle"]}
    settings = await client.call("GET", "/v1/config", into=dict)
    assert (settings["alpha"], settings["beta"], settings["confidence"]) == (0.5, 2.0, 0.8)


async def raw(url: str, method: str, path: str, body: object = None, data: bytes | None = None) -> tuple[int, dict]:
    """One call as JSON, without the client's error handling: the status and the error detail."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as session:
        async with session.request(method, url + path, json=body if data is None else None, data=data) as response:
            answer = await response.json()
            assert set(answer) == {"error"} and answer["error"]["code"] == response.status
            return response.status, answer["error"]


BAD_INPUT = [
    ("POST", "/v1/predict", {"prompt": "", "max_tokens": 8}, "the prompt is empty"),
    ("POST", "/v1/predict", {"prompt_token_ids": [], "max_tokens": 8}, "the prompt is empty"),
    ("POST", "/v1/predict", {"max_tokens": 8}, "exactly one of `prompt` (text) and `prompt_token_ids`"),
    ("POST", "/v1/predict", {"prompt": "a", "prompt_token_ids": [1], "max_tokens": 8}, "exactly one of"),
    ("POST", "/v1/predict", {"prompt": "a", "max_tokens": 0}, "Expected `int` >= 1 - at `$.max_tokens`"),
    ("POST", "/v1/predict", {"prompt": "a"}, "missing required field `max_tokens`"),
    ("POST", "/v1/predict", {"prompt": "a", "max_tokens": "8"}, "Expected `int`, got `str` - at `$.max_tokens`"),
    ("POST", "/v1/predict", {"prompt": 5, "max_tokens": 8}, "got `int` - at `$.prompt`"),
    ("POST", "/v1/predict", {"prompt_token_ids": ["a"], "max_tokens": 8}, "at `$.prompt_token_ids[0]`"),
    ("POST", "/v1/predict", {"prompt": "x" * 1_048_577, "max_tokens": 8}, "length <= 1048576 - at `$.prompt`"),
    ("POST", "/v1/predict", {**PROMPT, "slo": {"ttft_ms": -1}}, "Expected `float` > 0.0 - at `$.slo.ttft_ms`"),
    ("POST", "/v1/predict", {**PROMPT, "temperature": 0}, "unknown field `temperature`"),
    ("POST", "/v1/observe", {"actual": -1}, "Expected `int` >= 0 - at `$.actual`"),
    ("POST", "/v1/observe", {"tenant": "t"}, "missing required field `actual`"),
    ("PUT", "/v1/config", {"alpha": 1.0}, "Expected `float` < 1.0 - at `$.alpha`"),
    ("PUT", "/v1/config", {"beta": 0}, "Expected `float` > 0.0 - at `$.beta`"),
    ("PUT", "/v1/config", {"confidence": 0}, "Expected `float` > 0.0 - at `$.confidence`"),
    ("PUT", "/v1/config", {"adaptive": "yes"}, "Expected `bool | null`, got `str` - at `$.adaptive`"),
]


async def test_bad_input_gets_a_400_that_says_what_is_wrong(client):
    for method, path, body, message in BAD_INPUT:
        status, error = await raw(client.base_url, method, path, body)
        assert (status, error["type"]) == (400, "validation_error")
        assert message in error["message"], (body, error)
    status, error = await raw(client.base_url, "PUT", "/v1/config", {"predictor": "nope"})
    assert (status, error["message"]) == (400, "no length predictor named 'nope'; known: history, rlp, s3, oracle")
    status, error = await raw(client.base_url, "POST", "/v1/predict", data=b'{"prompt": ')
    assert status == 400 and error["type"] == "invalid_request" and "malformed JSON" in error["message"]
    assert (await client.call("GET", "/v1/config", into=dict))["predictor"] == "history"  # nothing changed
    assert 'status="500"' not in await metrics_text(client.base_url)


async def test_a_body_over_max_body_bytes_is_refused_as_too_large(start_predictor):
    url = start_predictor(KVMESH_PREDICTOR_MAX_BODY_BYTES="65536").url
    status, error = await raw(url, "POST", "/v1/predict", {"prompt": "x" * 70_000, "max_tokens": 8})
    assert (status, error["type"]) == (413, "payload_too_large")


async def metrics_text(url: str) -> str:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        return await response.text()


async def samples(url: str, family: str) -> dict[tuple[str, tuple], float]:
    """The samples of one metric family: (sample name, sorted labels) -> value."""
    for metric in text_string_to_metric_families(await metrics_text(url)):
        if metric.name == family:
            assert metric.documentation  # every family says what it counts
            return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in metric.samples}
    raise AssertionError(f"no metric family {family}")


async def test_metrics_count_the_error_and_the_provisioning_exactly(client):
    sequence = [(100, 120, 110),   # error 10, over-provisioned
                (100, 120, 150),   # error 50, under-provisioned
                (100, 100, 100),   # error 0, exact
                (300, 330, 90)]    # error 210, over-provisioned
    for predicted, estimated, actual in sequence:
        await observe(client, actual, predicted=predicted, estimated=estimated)
    await observe(client, 80)  # no prediction to compare: counted as an observation only
    url, history = client.base_url, (("predictor", "history"),)
    error = await samples(url, "kvmesh_predictor_abs_error_tokens")
    assert error[("kvmesh_predictor_abs_error_tokens_count", history)] == 4
    assert error[("kvmesh_predictor_abs_error_tokens_sum", history)] == 270
    cumulative = {le: error[("kvmesh_predictor_abs_error_tokens_bucket", (("le", le), *history))]
                  for le in ("0.0", "10.0", "20.0", "50.0", "200.0", "500.0", "+Inf")}
    assert cumulative == {"0.0": 1, "10.0": 2, "20.0": 2, "50.0": 3, "200.0": 3, "500.0": 4, "+Inf": 4}
    assert (await samples(url, "kvmesh_predictor_underprovisioned"))[
        ("kvmesh_predictor_underprovisioned_total", history)] == 1
    assert (await samples(url, "kvmesh_predictor_overprovisioned"))[
        ("kvmesh_predictor_overprovisioned_total", history)] == 2
    assert (await samples(url, "kvmesh_predictor_observations"))[
        ("kvmesh_predictor_observations_total", history)] == 5

    await configure(client, predictor="rlp")
    await observe(client, 400, predicted=173, estimated=273)
    under = await samples(url, "kvmesh_predictor_underprovisioned")
    assert under[("kvmesh_predictor_underprovisioned_total", (("predictor", "rlp"),))] == 1
    assert under[("kvmesh_predictor_underprovisioned_total", history)] == 1


def test_admission_is_not_disturbed_by_the_predictor_url():
    """`kvmesh up` hands KVMESH_PREDICTOR_URL to admission: load_config reads only declared fields, so
    until admission declares `predictor_url` the variable changes nothing."""
    def admission(env: dict[str, str]) -> dict:
        loaded = msgspec.to_builtins(load_config(AdmissionConfig, "admission", env=env))
        loaded.pop("predictor_url", None)
        return loaded

    assert admission({"KVMESH_PREDICTOR_URL": "http://127.0.0.1:8101"}) == admission({})
