"""`kvmesh up --backend vllm`: the local cluster with its engines on stock vLLM, as a user starts it."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from kvmesh.services.engine.model_source import DEFAULT_MODEL

from ..integration.admission_fixtures import wait_until_idle
from ..integration.test_launcher import COLOCATED, SERVICES, running_cluster, status


@pytest.mark.parametrize("topology", [["--colocated"], []], ids=["colocated", "1p1d"])
async def test_up_on_vllm_serves_the_default_model_in_both_topologies(vllm_model: Path, tmp_path: Path,
                                                                      topology: list[str]):
    """No --model: SmolLM2-135M-Instruct, its context cut to what the KV cache vLLM is given holds
    (vLLM refuses to start when one request of its max_model_len does not fit)."""
    names = COLOCATED if topology else SERVICES
    with running_cluster(tmp_path / "run", names, "--backend", "vllm", *topology, timeout=300) as (launcher, run_dir):
        children = {c.name: c for c in status(run_dir).children}
        key = (run_dir / "api_key").read_text().strip()
        async with openai.AsyncOpenAI(base_url=children["admission"].url + "/v1", api_key=key,
                                      max_retries=0) as client:
            answer = await client.chat.completions.create(
                model=DEFAULT_MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                max_tokens=24, temperature=0)
            if not topology:  # 1P1D: the decode engine's prompt KV came from the prefill engine, a block at least
                reply = await client.completions.create(model=DEFAULT_MODEL, prompt="hello " * 40, max_tokens=6,
                                                        temperature=0.0)
                assert reply.usage.completion_tokens == 6 and reply.usage.prompt_tokens_details.cached_tokens >= 32
        assert "Paris" in answer.choices[0].message.content
        token = (run_dir / "token").read_text().strip()
        for name in names[4:-1]:  # the engines
            state = await wait_until_idle(children[name].url, timeout=10, token=token)
            assert state["backend"] == "vllm" and state["free_blocks"] == state["total_blocks"]
    assert launcher.returncode == 0
