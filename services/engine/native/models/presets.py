"""Random-initialised `tiny` / `small` models and the offline BPE tokenizer they speak, for runs without weights.

`build_preset` gives our CausalLM directly; `save_preset_checkpoint` writes the same weights as a
Hugging Face checkpoint directory that transformers and `load_checkpoint` both read.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, PretrainedConfig,
                          PreTrainedModel, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM)

from .config import ModelConfig
from .llama import CausalLM

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")  # the trainer gives them ids 0..3 in this order
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(len(SPECIAL_TOKENS))
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

PRESETS: dict[str, ModelConfig] = {
    # ~4M parameters: unit tests and the engine's fast paths.
    "tiny": ModelConfig(
        architecture="llama", vocab_size=2048, hidden_size=256, intermediate_size=688, num_layers=4, num_heads=4,
        num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=2048,
        bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,)),
    # ~28M parameters: what a 2-core CPU serves at a few requests per second.
    "small": ModelConfig(
        architecture="llama", vocab_size=8192, hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8,
        num_kv_heads=4, head_dim=64, rms_norm_eps=1e-5, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,)),
}

HF_CLASSES: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def build_preset(name: str | ModelConfig, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 seed: int = 0) -> tuple[CausalLM, PreTrainedTokenizerFast]:
    """A preset (or any config) with random weights from `seed`, and the offline tokenizer of its vocab size."""
    config = _config(name)
    model = CausalLM(config, device=device, dtype=dtype)
    init_random(model, seed)
    return model, offline_tokenizer(config.vocab_size)


def save_preset_checkpoint(name_or_config: str | ModelConfig, path: str | Path, seed: int = 0,
                           **overrides: object) -> Path:
    """Write a Hugging Face checkpoint (float32 safetensors, config.json, tokenizer) of a preset.

    `overrides` replace ModelConfig fields, e.g. architecture="qwen2", attention_bias=True, or
    rope_scaling={"rope_type": "linear", "factor": 2.0}. The weights are `build_preset`'s for the same
    config and seed.
    """
    config = replace(_config(name_or_config), **overrides)
    model, tokenizer = build_preset(config, seed=seed)
    config_class, model_class = HF_CLASSES[config.architecture]
    hf_model = model_class(config_class(**hf_config_kwargs(config)))
    missing, unexpected = hf_model.load_state_dict(model.hf_state_dict(), strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if config.tie_word_embeddings else set()):
        raise RuntimeError(f"weights do not fit {model_class.__name__}: missing {missing}, unexpected {unexpected}")
    hf_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return Path(path)


def hf_config_kwargs(config: ModelConfig) -> dict[str, object]:
    """ModelConfig -> keyword arguments of the architecture's transformers config class."""
    eos = config.eos_token_ids
    kwargs: dict[str, object] = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim, rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta},
        max_position_embeddings=config.max_position_embeddings, tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id, eos_token_id=list(eos) if len(eos) > 1 else (eos[0] if eos else None),
        pad_token_id=PAD_ID,
    )
    if config.architecture == "llama":
        kwargs["attention_bias"] = config.attention_bias
    if config.architecture == "mistral":
        kwargs["sliding_window"] = config.sliding_window
    return kwargs


@torch.no_grad()
def init_random(model: CausalLM, seed: int, std: float = 0.02) -> None:
    """Draw every parameter from N(0, std) (norm weights from 1 + N(0, std)) on CPU in float32.

    Drawing on CPU gives the same model on every device and dtype. Biases and norm weights are random
    rather than HF's zeros and ones, so that comparing against transformers exercises every tensor.
    """
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        values = torch.randn(param.shape, generator=generator) * std
        param.copy_(values + 1 if name.endswith("norm") else values)


def offline_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of exactly `vocab_size` tokens, trained on the shipped corpus.

    Training is deterministic and cached per size; each call returns a fresh tokenizer object. Encoding
    prepends <s> (as Llama's tokenizer does); the chat template ends each turn with </s>.
    """
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_bpe(vocab_size)), bos_token="<s>", eos_token="</s>",
        unk_token="<unk>", pad_token="<pad>", chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)


@lru_cache(maxsize=None)
def _trained_bpe(vocab_size: int) -> str:
    """The trained tokenizers.Tokenizer, serialised (~0.2 s to train the first time)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus_lines(), trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"the offline corpus yields {tokenizer.get_vocab_size()} BPE tokens, not {vocab_size}: "
                         f"pick a vocab_size between {256 + len(SPECIAL_TOKENS)} and that")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", BOS_ID)])
    return tokenizer.to_str()


def corpus_lines() -> list[str]:
    """corpus.txt (hand-written), its title-cased and upper-cased copies, and a multiplication table.

    The copies and the table only widen the set of distinct words and numbers, so BPE can reach ~10k
    tokens from 24 KB of prose.
    """
    lines = Path(__file__).with_name("corpus.txt").read_text(encoding="utf-8").splitlines()
    table = [", ".join(f"{a} x {b} = {a * b}" for b in range(2, 100, 3)) + "." for a in range(2, 100)]
    return [*lines, *(line.title() for line in lines), *(line.upper() for line in lines), *table]


def _config(name: str | ModelConfig) -> ModelConfig:
    if isinstance(name, ModelConfig):
        return name
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name]
