"""Engine fixtures: a tiny random checkpoint saved with save_pretrained, and helpers to run an
in-process engine to completion and to ask transformers for the reference."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.libs.messages.engine import SamplingParams
from kvmesh.services.engine.config import EngineConfig
from kvmesh.services.engine.native.engine import Engine
from kvmesh.services.engine.native.factory import build_engine

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvmesh.services.engine.native.models import save_preset_checkpoint

    path = tmp_path_factory.mktemp("tiny-llama")
    save_preset_checkpoint("tiny", path, seed=0)
    return path


@pytest.fixture(scope="session")
def hf_model(tiny_checkpoint: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # run every request to max_new_tokens, as ignore_eos does
    model.generation_config.pad_token_id = 0
    return model.eval()


def engine_for(checkpoint: Path, **overrides) -> Engine:
    """An in-process engine, in float32 unless told otherwise (compared with transformers' float32)."""
    return build_engine(EngineConfig(model=str(checkpoint), **{"dtype": "float32", **overrides}))


def run_all(engine: Engine, prompts: list[list[int]], params: SamplingParams, max_steps: int = 10_000) -> list:
    """Add every prompt at once (served concurrently) and step until all finish; returns the requests."""
    requests = [engine.add(f"r{i}", p, params) for i, p in enumerate(prompts)]
    for _ in range(max_steps):
        if not engine.scheduler.has_work():
            break
        engine.step()
    assert all(r.finished for r in requests)
    return requests


def loop_failures(log: Path) -> list[str]:
    """The lines of an engine service's log where its loop caught an exception of its own code: it
    logs it and goes on, so only the log tells."""
    return [line for line in log.read_text(errors="replace").splitlines()
            if "engine command failed" in line or "engine step failed" in line]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation and the logprob of each chosen token."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             output_scores=False, output_logits=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def assert_all_blocks_free(engine: Engine) -> None:
    view = engine.blocks.pool_view()
    assert view.free == view.total, f"blocks leaked: free {view.free} of {view.total}"
