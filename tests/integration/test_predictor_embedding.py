"""The `embedding` length predictor end to end with the real encoder: `kvmesh predictor train` as a
process on a DATA.jsonl whose prompt wording carries the length, then the predictor service serving
that model on loopback: predictions with Eq. 3 padding in the classifier's direction, learning and a
refit from `/v1/observe` with prompt text, and bad input refused with a 4xx."""

from __future__ import annotations

import asyncio
import json
import math
import random
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from kvmesh.libs.controlplane import ConfigError, ServiceClient, load_config
from kvmesh.policies.length import Direction, confidence_padding, padded_length
from kvmesh.services.predictor.app import NO_MODEL, Config

from ..conftest import TOKEN
from .admission_fixtures import launch, ready
from .test_predictor import metrics_text, raw, samples

SHORT = ["Write a one-sentence answer: what is {}?", "Answer in a few words: who first studied {}?"]
LONG = ["Write a detailed multi-paragraph essay about {}.", "Write a long, in-depth, step-by-step tutorial on {}."]
TYPICAL = {**{s: 20 for s in SHORT}, **{s: 600 for s in LONG}}  # tokens
TOPICS = ["the French revolution", "photosynthesis", "black holes", "the stock market", "machine learning",
          "the Roman empire", "climate change", "jazz music", "the immune system", "volcanoes", "honey bees",
          "the printing press", "plate tectonics", "the Silk Road", "quantum computing", "the water cycle",
          "ancient Egypt", "vaccines", "the Renaissance", "electric cars"]
AUDIENCES = ["", " for a ten-year-old", " for a university student", " for an expert", " in plain English",
             " for a newspaper"]
UNSEEN = ["the history of tea", "coral reefs", "medieval castles"]  # topics training never saw
ENV = {"KVMESH_PREDICTOR_PREDICTOR": "embedding", "KVMESH_PREDICTOR_ADAPTIVE": "false",
       "KVMESH_PREDICTOR_TORCH_THREADS": "1"}


def examples(n: int, seed: int) -> list[dict]:
    """n different prompts of the four wordings on the training topics and audiences; their lengths
    lognormal around the wording's."""
    rng = random.Random(seed)
    prompts = [(wording, topic + audience) for wording in TYPICAL for topic in TOPICS for audience in AUDIENCES]
    return [{"prompt": wording.format(subject), "tenant": "t",
             "output_len": max(1, round(TYPICAL[wording] * rng.lognormvariate(0, 0.25)))}
            for wording, subject in rng.sample(prompts, n)]


@pytest.fixture(scope="session")  # read only: the predictor's tests and admission's share one training
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    """`kvmesh predictor train` on 300 examples: the model directory, its meta and what it printed."""
    root = tmp_path_factory.mktemp("embedding")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in examples(300, seed=0)))
    done = subprocess.run([sys.executable, "-m", "kvmesh", "predictor", "train", str(data), "--out",
                           str(root / "model"), "--threads", "1", "--seed", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return root / "model", json.loads((root / "model" / "meta.json").read_text()), done.stdout


@pytest.fixture(scope="module")
def served(trained, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A predictor serving the trained model, `embedding` in force, c fixed at 0.9; no refit in reach."""
    with ExitStack() as stack:
        yield ready(stack, launch("predictor", tmp_path_factory.mktemp("served"), **ENV,
                                  KVMESH_PREDICTOR_MODEL_PATH=str(trained[0]))).url


@pytest.fixture
async def client(served) -> AsyncIterator[ServiceClient]:
    async with ServiceClient(served, token=TOKEN) as c:
        yield c


async def predict(client: ServiceClient, prompt: str, max_tokens: int = 4000) -> dict:
    return await client.call("POST", "/v1/predict", {"prompt": prompt, "max_tokens": max_tokens, "tenant": "t"},
                             into=dict)


def test_training_beats_the_mean_length_and_writes_its_range(trained):
    directory, meta, printed = trained
    stats = meta["training"]
    assert stats["mae"] < 0.5 * stats["baseline_mae"]  # measured: 79.8 vs 285.0 tokens
    assert 0 <= stats["direction_accuracy"] <= 1 and (stats["examples"], stats["validation_examples"]) == (270, 30)
    assert meta["error_low"] < 0 < meta["error_high"] and meta["encoder"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert sorted(p.name for p in directory.iterdir()) == ["meta.json", "model.safetensors"]
    assert "MAE" in printed and "direction accuracy" in printed


async def test_predictions_follow_the_wording_with_eq3_padding(client, trained):
    meta = trained[1]
    short = [await predict(client, s.format(t)) for s in SHORT for t in UNSEEN]
    long = [await predict(client, s.format(t)) for s in LONG for t in UNSEEN]
    assert max(p["predicted"] for p in short) * 4 < min(p["predicted"] for p in long)
    for p in short + long:
        error_range = (1 + p["predicted"]) * (math.exp(meta["error_high"]) - math.exp(meta["error_low"]))
        assert p["padding"] == pytest.approx(confidence_padding(0.9, error_range))
        assert p["estimated"] == padded_length(p["predicted"], p["padding"], Direction(p["direction"]), 4000)
        assert (p["confidence"], p["predictor"]) == (0.9, "embedding")
    capped = await predict(client, LONG[0].format(UNSEEN[0]), max_tokens=50)
    assert capped["estimated"] <= 50


async def test_token_ids_alone_fall_back_to_the_history(client):
    answer = await client.call("POST", "/v1/predict", {"prompt_token_ids": [1, 2, 3], "max_tokens": 321,
                                                       "tenant": "nobody"}, into=dict)
    assert (answer["predicted"], answer["estimated"], answer["predictor"]) == (321, 321, "embedding")


async def test_config_offers_embedding_with_a_model(client):
    settings = await client.call("GET", "/v1/config", into=dict)
    assert settings["predictor"] == "embedding" and "embedding" in settings["available"]
    assert (await client.call("PUT", "/v1/config", {"predictor": "history"}, into=dict))["predictor"] == "history"
    assert (await client.call("PUT", "/v1/config", {"predictor": "embedding"}, into=dict))["predictor"] == "embedding"


BAD_INPUT = [
    ("/v1/observe", {"actual": 5, "prompt": ""}, "the prompt is empty"),
    ("/v1/observe", {"actual": 5, "prompt": 7}, "Expected `str | null`, got `int` - at `$.prompt`"),
    ("/v1/observe", {"actual": 5, "prompt": ["a"]}, "got `array` - at `$.prompt`"),
    ("/v1/observe", {"actual": "5", "prompt": "a"}, "Expected `int`, got `str` - at `$.actual`"),
    ("/v1/observe", {"actual": 5, "prompt": "x" * 1_048_577}, "length <= 1048576 - at `$.prompt`"),
    ("/v1/predict", {"prompt": "", "max_tokens": 8}, "the prompt is empty"),
    ("/v1/predict", {"prompt": "x" * 1_048_577, "max_tokens": 8}, "length <= 1048576 - at `$.prompt`"),
]


async def test_bad_input_gets_a_400(client):
    for path, body, message in BAD_INPUT:
        status, error = await raw(client.base_url, "POST", path, body)
        assert (status, error["type"]) == (400, "validation_error") and message in error["message"], (body, error)
    # The largest prompt accepted is embedded from its first 256 tokens, quickly.
    assert (await predict(client, "essay " * 174_762))["predictor"] == "embedding"
    assert 'status="500"' not in await metrics_text(client.base_url)


async def test_observed_prompts_are_learned_and_refitted(trained, tmp_path):
    with ExitStack() as stack:
        url = ready(stack, launch("predictor", tmp_path, **ENV, KVMESH_PREDICTOR_MODEL_PATH=str(trained[0]),
                                  KVMESH_PREDICTOR_REFIT_EVERY="40")).url
        async with ServiceClient(url, token=TOKEN) as client:
            for row in examples(40, seed=1):
                prediction = await predict(client, row["prompt"])
                await client.call("POST", "/v1/observe", {
                    "actual": row["output_len"], "tenant": "t", "prompt": row["prompt"],
                    "predicted": prediction["predicted"], "estimated": prediction["estimated"]})
            refits = {}
            for _ in range(100):  # the refit runs in its own thread after the 40th observation
                refits = {dict(labels)["outcome"]: value for (name, labels), value in
                          (await samples(url, "kvmesh_predictor_refits")).items() if name.endswith("_total")}
                if refits:
                    break
                await asyncio.sleep(0.1)
            assert sum(refits.values()) == 1 and set(refits) <= {"installed", "kept"}
            observed = await samples(url, "kvmesh_predictor_observations")
            assert observed[("kvmesh_predictor_observations_total", (("predictor", "embedding"),))] == 40
            kept = await samples(url, "kvmesh_predictor_embedding_examples")
            assert kept[("kvmesh_predictor_embedding_examples", ())] == 40
            errors = await samples(url, "kvmesh_predictor_abs_error_tokens")
            assert errors[("kvmesh_predictor_abs_error_tokens_count", (("predictor", "embedding"),))] == 40
            short = await predict(client, SHORT[0].format(UNSEEN[1]))
            long = await predict(client, LONG[0].format(UNSEEN[1]))
            assert short["predicted"] * 4 < long["predicted"]


async def test_embedding_without_a_model_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="the embedding predictor needs a trained model: set model_path"):
        load_config(Config, "predictor", env={"KVMESH_PREDICTOR_PREDICTOR": "embedding"})
    with pytest.raises(ConfigError, match="is not a directory"):
        load_config(Config, "predictor", env={"KVMESH_PREDICTOR_MODEL_PATH": str(tmp_path / "none")})
    with ExitStack() as stack:
        url = ready(stack, launch("predictor", tmp_path)).url
        assert "embedding" not in (await raw_settings(url))["available"]
        status, error = await raw(url, "PUT", "/v1/config", {"predictor": "embedding"})
        assert (status, error["message"]) == (400, NO_MODEL)


async def raw_settings(url: str) -> dict:
    async with ServiceClient(url, token=TOKEN) as client:
        return await client.call("GET", "/v1/config", into=dict)
