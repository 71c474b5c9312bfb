"""services/engine/models: our CausalLM against transformers on tiny random checkpoints, plus config,
rotary, checkpoint loading, presets and the offline tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerBase
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kvmesh.services.engine.native.models import (PRESETS, CausalLM, ModelConfig, build_preset, load_checkpoint,
                                                  save_preset_checkpoint)
from kvmesh.services.engine.native.models.presets import (BOS_ID, EOS_ID, PAD_ID, _trained_bpe, hf_config_kwargs,
                                                          offline_tokenizer)
from kvmesh.services.engine.native.models.rope import RotaryEmbedding, apply_rotary

# Small enough that transformers builds and runs it in milliseconds; max positions 64 covers the prompts.
CONFIG = ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64,
                     bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,))
PROMPTS = [
    "The morning train left the station a few minutes late, and most of the passengers did not notice at all.",
    "Hello",
    "Cooking rice well is mostly a matter of patience: rinse, rest, boil, wait.",
]
# Config overrides per rope variant. Dynamic NTK rescales past max_position_embeddings, which the longer
# prompts (~50 tokens) pass; llama3 spans all three wavelength bands; the larger YaRN originals put the
# interpolation ramp over several dimensions, so truncation and the betas matter.
ROPE_VARIANTS: dict[str, dict[str, object]] = {
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "dynamic": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 16},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
               "max_position_embeddings": 256},
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}},
    "yarn-attention-factor": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.5,
                                               "beta_fast": 16.0, "beta_slow": 2.0,
                                               "original_max_position_embeddings": 1024},
                              "max_position_embeddings": 4096},
    "yarn-mscale-untruncated": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                                 "mscale_all_dim": 0.5, "truncate": False,
                                                 "original_max_position_embeddings": 1024},
                                "max_position_embeddings": 4096},
}


def with_rope(name: str) -> ModelConfig:
    return CONFIG if name == "default" else replace(CONFIG, **ROPE_VARIANTS[name])


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class ContiguousAttention:
    """The attention contract without paging: causal SDPA within each sequence of one forward call.

    Every call sees whole prompts (no earlier context), so the keys are exactly the call's own k and v.
    """

    def __init__(self, lengths: list[int]) -> None:
        self.starts = torch.tensor([0, *lengths]).cumsum(0).tolist()

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty(q.shape)
        for start, end in zip(self.starts, self.starts[1:]):
            heads_first = [x[start:end].transpose(0, 1) for x in (q, k, v)]
            o = F.scaled_dot_product_attention(*heads_first, is_causal=True, enable_gqa=True)
            out[start:end] = o.transpose(0, 1)
        return out


def tokenize(tokenizer: PreTrainedTokenizerBase, prompts: list[str] = PROMPTS) -> list[list[int]]:
    return [tokenizer(p)["input_ids"] for p in prompts]


@torch.inference_mode()
def our_logits(model: CausalLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """All prompts flattened into one forward call, logits split back per prompt."""
    lengths = [len(p) for p in prompts]
    input_ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(n) for n in lengths])
    logits = model.logits(model(input_ids, positions, ContiguousAttention(lengths)))
    return list(logits.split(lengths))


@torch.inference_mode()
def hf_logits(path: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """One right-padded batch through transformers, so dynamic NTK sees the batch's longest prompt as ours does."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    longest = max(len(p) for p in prompts)
    input_ids = torch.tensor([p + [0] * (longest - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (longest - len(p)) for p in prompts])
    logits = model(input_ids=input_ids, attention_mask=mask).logits
    return [row[:len(p)] for row, p in zip(logits, prompts)]


def assert_logits_match_transformers(path: Path) -> CausalLM:
    model, tokenizer = load_checkpoint(path)
    prompts = tokenize(tokenizer)
    for ours, theirs in zip(our_logits(model, prompts), hf_logits(path, prompts)):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    return model


# --- the model against transformers -------------------------------------------------------------------

@pytest.mark.parametrize("architecture", ["llama", "qwen2", "mistral"])
def test_logits_match_transformers(tmp_path: Path, architecture: str) -> None:
    path = save_preset_checkpoint(CONFIG, tmp_path, seed=1, architecture=architecture,
                                  attention_bias=architecture == "qwen2")
    model = assert_logits_match_transformers(path)
    assert model.config.architecture == architecture
    assert (model.layers[0].qkv_bias is not None) == (architecture == "qwen2")


def test_llama_attention_bias_also_biases_o_proj(tmp_path: Path) -> None:
    path = save_preset_checkpoint(CONFIG, tmp_path, seed=2, attention_bias=True)
    model = assert_logits_match_transformers(path)
    assert model.layers[0].o_bias is not None


@pytest.mark.parametrize("name", ROPE_VARIANTS)
def test_rope_scaling_logits_match_transformers(tmp_path: Path, name: str) -> None:
    assert_logits_match_transformers(save_preset_checkpoint(with_rope(name), tmp_path, seed=3))


@pytest.mark.parametrize("name", ["default", *ROPE_VARIANTS])
def test_rotary_matches_transformers_at_arbitrary_positions(name: str) -> None:
    config = with_rope(name)
    # unsorted, repeated positions as in a flattened batch; the longest reaches 41
    positions = torch.tensor([0, 37, 5, 40, 12, 1, 40, 3])
    q = torch.randn(len(positions), config.num_heads, config.head_dim, generator=torch.Generator().manual_seed(0))
    ours = apply_rotary(q, *RotaryEmbedding(config)(positions, torch.float32))

    hf_rotary = LlamaRotaryEmbedding(LlamaConfig(**hf_config_kwargs(config)))
    cos, sin = hf_rotary(q, positions[None])
    theirs, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(ours, theirs[0].transpose(0, 1), atol=1e-6, rtol=0)


def test_dynamic_ntk_scales_by_the_longest_position_of_the_call() -> None:
    # factor 1.3: the NTK formula at exactly max_position_embeddings is 1 ulp off the default frequencies
    config = replace(with_rope("dynamic"), rope_scaling={"rope_type": "dynamic", "factor": 1.3})
    rotary, default = RotaryEmbedding(config), RotaryEmbedding(replace(CONFIG, max_position_embeddings=16))
    short, long = torch.arange(16), torch.cat([torch.arange(16), torch.tensor([40])])
    # within max_position_embeddings the frequencies are the default ones
    torch.testing.assert_close(rotary(short, torch.float32), default(short, torch.float32), atol=0, rtol=0)
    # one long sequence in the call rescales theta for every token of the call
    cos_long, _ = rotary(long, torch.float32)
    cos_short, _ = rotary(short, torch.float32)
    assert not torch.allclose(cos_long[1:16], cos_short[1:16])


@torch.inference_mode()
def test_flattened_batch_matches_each_sequence_alone() -> None:
    model, tokenizer = build_preset(CONFIG, seed=4)
    prompts = tokenize(tokenizer)
    together = our_logits(model, prompts)
    for prompt, logits in zip(prompts, together):
        torch.testing.assert_close(our_logits(model, [prompt])[0], logits, atol=1e-5, rtol=0)


def test_tied_embeddings_share_the_lm_head(tmp_path: Path) -> None:
    path = save_preset_checkpoint(CONFIG, tmp_path, seed=5, tie_word_embeddings=True)
    with safe_open(path / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    model = assert_logits_match_transformers(path)
    assert model.lm_head is None

    tensors = load_file(path / "model.safetensors")
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"] + 1}, path / "model.safetensors")
    with pytest.raises(ValueError, match="ties word embeddings but lm_head.weight differs"):
        load_checkpoint(path)


def test_sharded_checkpoint_follows_its_index(tmp_path: Path) -> None:
    whole = save_preset_checkpoint(CONFIG, tmp_path / "whole", seed=6)
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(whole).save_pretrained(sharded, max_shard_size="100KB")
    offline_tokenizer(CONFIG.vocab_size).save_pretrained(sharded)
    shards = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"].values()
    assert len(set(shards)) > 1
    (sharded / "stray.safetensors").write_bytes(b"not in the index, never read")

    model, tokenizer = load_checkpoint(sharded)
    reference, _ = load_checkpoint(whole)
    prompts = tokenize(tokenizer)
    for a, b in zip(our_logits(model, prompts), our_logits(reference, prompts)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_bfloat16_runs_close_to_float32() -> None:
    model32, tokenizer = build_preset("tiny")
    model16, _ = build_preset("tiny", dtype=torch.bfloat16)
    assert model16.embed_tokens.dtype == torch.bfloat16
    prompts = tokenize(tokenizer)
    for a, b in zip(our_logits(model32, prompts), our_logits(model16, prompts)):
        assert b.dtype == torch.float32 and b.isfinite().all()
        torch.testing.assert_close(b, a, atol=5e-2, rtol=0)


# --- checkpoints and configs ---------------------------------------------------------------------------

def test_preset_checkpoint_holds_build_preset_weights(tmp_path: Path) -> None:
    path = save_preset_checkpoint("tiny", tmp_path, seed=7)
    loaded, tokenizer = load_checkpoint(path)
    built, built_tokenizer = build_preset("tiny", seed=7)
    assert loaded.config == PRESETS["tiny"]
    built_tensors = built.hf_state_dict()
    for name, tensor in loaded.hf_state_dict().items():
        assert torch.equal(tensor, built_tensors[name]), name
    assert tokenizer(PROMPTS[0])["input_ids"] == built_tokenizer(PROMPTS[0])["input_ids"]
    assert tokenizer.chat_template == built_tokenizer.chat_template
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)


def test_load_checkpoint_works_offline(tmp_path: Path) -> None:
    path = save_preset_checkpoint(CONFIG, tmp_path, seed=8)
    script = ("import sys; from kvmesh.services.engine.native.models import load_checkpoint; "
              "model, tok = load_checkpoint(sys.argv[1]); print(model.config.vocab_size, len(tok))")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script, str(path)], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["512", "512"]


def test_load_errors_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_checkpoint(tmp_path)

    path = save_preset_checkpoint(CONFIG, tmp_path / "ckpt", seed=9)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_checkpoint(path)

    (path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ValueError, match="gate_proj.weight: checkpoint shape"):
        load_checkpoint(path)

    (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(KeyError, match="model.layers.2"):
        load_checkpoint(path)

    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        load_checkpoint(path)


def test_config_from_hf_reads_transformers_4_configs() -> None:
    config = ModelConfig.from_hf({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 131072, "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    })
    assert (config.architecture, config.head_dim, config.num_kv_heads) == ("llama", 128, 8)
    assert config.rope_theta == 500000.0 and config.rope_type == "llama3"
    assert config.rope_scaling["original_max_position_embeddings"] == 8192
    assert config.eos_token_ids == (128001, 128008, 128009)
    assert not config.attention_bias and not config.tie_word_embeddings

    legacy = ModelConfig.from_hf({
        "architectures": ["Qwen2ForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "eos_token_id": 7,
        "tie_word_embeddings": True, "rope_scaling": {"type": "yarn", "factor": 4.0}, "max_position_embeddings": 512,
    })
    assert legacy.attention_bias and legacy.tie_word_embeddings and legacy.eos_token_ids == (7,)
    assert legacy.head_dim == 16 and legacy.bos_token_id is None
    assert legacy.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}


def test_config_from_hf_reads_transformers_5_configs(tmp_path: Path) -> None:
    path = save_preset_checkpoint(with_rope("yarn"), tmp_path, seed=10, architecture="mistral")
    config = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    assert config == replace(with_rope("yarn"), architecture="mistral")


def test_config_rejects_what_the_model_cannot_run() -> None:
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2}
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM, Qwen2ForCausalLM"):
        ModelConfig.from_hf({**base, "architectures": ["GPTNeoXForCausalLM"]})
    with pytest.raises(ValueError, match="unsupported rope_type 'longrope'"):
        ModelConfig.from_hf({**base, "architectures": ["LlamaForCausalLM"],
                             "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}})
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf({**base, "architectures": ["MistralForCausalLM"], "hidden_act": "gelu"})


# --- presets and the offline tokenizer ------------------------------------------------------------------

def test_build_preset_is_deterministic_per_seed() -> None:
    a, b, c = (build_preset(CONFIG, seed=s)[0] for s in (0, 0, 1))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embed_tokens, c.embed_tokens)


def test_tokenizer_round_trips_text() -> None:
    tokenizer = offline_tokenizer(PRESETS["tiny"].vocab_size)
    texts = [*PROMPTS, "  two  spaces,\ttabs\nand newlines\n", "naïve café — 東京 🚀",
             "def f(x):\n    return x**2\n", ""]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == BOS_ID
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert len(tokenizer(PROMPTS[0])["input_ids"]) < len(PROMPTS[0]) / 2  # BPE merged words, not bytes


def test_tokenizer_training_is_deterministic_and_sized() -> None:
    for preset in PRESETS.values():
        assert _trained_bpe.__wrapped__(preset.vocab_size) == _trained_bpe.__wrapped__(preset.vocab_size)
        tokenizer = offline_tokenizer(preset.vocab_size)
        assert len(tokenizer) == preset.vocab_size
        assert tokenizer.convert_ids_to_tokens([0, 1, 2, 3]) == ["<unk>", "<s>", "</s>", "<pad>"]
        assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (preset.bos_token_id, preset.eos_token_ids[0])
    with pytest.raises(ValueError, match="BPE tokens"):
        _trained_bpe.__wrapped__(100_000)


def test_chat_template_marks_turns() -> None:
    tokenizer = offline_tokenizer(CONFIG.vocab_size)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<s><|system|>\nBe brief.</s>\n<|user|>\nHi!</s>\n<|assistant|>\n"
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1 and ids.count(EOS_ID) == 2
