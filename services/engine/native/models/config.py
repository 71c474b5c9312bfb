"""ModelConfig: the shape of a Llama-family decoder, read from a Hugging Face config.json or a preset."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Hugging Face class name -> our architecture name.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}
# The rope_type values rope.py implements (the HF Llama set, less longrope).
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class ModelConfig:
    """A Llama / Qwen2 / Mistral decoder.

    `rope_scaling` is None for plain RoPE, else the Hugging Face dict normalised to carry "rope_type"
    (never the legacy "type") and no "rope_theta" (that is `rope_theta`). `attention_bias` is the q/k/v
    bias; Llama's flag also biases o_proj (see `o_proj_bias`). `sliding_window` is recorded for the
    engine, which must keep contexts within it: the model itself never sees the window.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES.values():
            raise ValueError(f"unsupported architecture {self.architecture!r}; "
                             f"expected one of {sorted(ARCHITECTURES.values())}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        if self.rope_scaling is not None and "rope_type" not in self.rope_scaling:
            raise ValueError(f"rope_scaling needs a rope_type, got {self.rope_scaling}")
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope_type {self.rope_type!r}; expected one of {ROPE_TYPES}")
        # Qwen2 always has q/k/v biases and Mistral never does: their HF classes have no switch.
        if self.architecture == "qwen2" and not self.attention_bias:
            raise ValueError("qwen2 always has q/k/v biases: set attention_bias=True")
        if self.architecture == "mistral" and self.attention_bias:
            raise ValueError("mistral has no attention biases: set attention_bias=False")

    @property
    def o_proj_bias(self) -> bool:
        return self.architecture == "llama" and self.attention_bias

    @property
    def rope_type(self) -> str:
        return self.rope_scaling["rope_type"] if self.rope_scaling else "default"

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Read the config.json dict of a LlamaForCausalLM, Qwen2ForCausalLM or MistralForCausalLM.

        Accepts both config formats: transformers < 5 (`rope_theta` + `rope_scaling`) and >= 5
        (`rope_parameters`, which holds the theta too).
        """
        names = hf.get("architectures") or []
        architecture = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
        if architecture is None and not names and hf.get("model_type") in ARCHITECTURES.values():
            architecture = hf["model_type"]
        if architecture is None:
            found = names or hf.get("model_type") or "none given"
            raise ValueError(f"unsupported architecture {found!r}: kvmesh serves {', '.join(ARCHITECTURES)}")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf['hidden_act']!r}: only silu (SwiGLU) is implemented")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if hf.get("use_sliding_window"):
            raise ValueError("Qwen2's per-layer sliding window (use_sliding_window=True) is not supported")

        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        return cls(
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            **_rope_from_hf(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            attention_bias=architecture == "qwen2" or (architecture == "llama" and hf.get("attention_bias", False)),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, list) else (eos,),
            sliding_window=hf.get("sliding_window") if architecture == "mistral" else None,
        )


def _rope_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
    """rope_theta and the normalised rope_scaling, with the precedence transformers gives them."""
    rope = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", None)
    theta = theta if theta is not None else hf.get("rope_theta", 10000.0)
    legacy_type = rope.pop("type", "default")
    rope_type = rope.pop("rope_type", legacy_type)
    if rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return {"rope_theta": float(theta), "rope_scaling": None}
    if rope_type in ("llama3", "yarn"):
        # transformers lets a top-level original_max_position_embeddings win, else defaults it
        original = hf.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
        rope["original_max_position_embeddings"] = original or hf.get("max_position_embeddings", 2048)
    return {"rope_theta": float(theta), "rope_scaling": {"rope_type": rope_type, **rope}}
