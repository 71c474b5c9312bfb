"""The shapes of the papers' models, and of the models the GPU profiles are checked on, from each
model's config.json: what the roofline step cost (sim/roofline.py) counts FLOPs and bytes with.
Biases, norms and OPT's learned positions are left out (under 0.5% of the weights)."""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil


@dataclass(frozen=True, slots=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated_mlp: bool        # SwiGLU: gate, up and down matrices; OPT's fc1 and fc2: two
    tied_embeddings: bool  # one matrix is both the input embedding and the LM head
    source: str

    @property
    def linear_params(self) -> int:
        """The transformer blocks' matrices: each multiplied once per token, 2 FLOPs a parameter."""
        attention = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return self.layers * (attention + mlp)

    @property
    def params(self) -> int:
        """Every weight the GPUs hold."""
        return self.linear_params + self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def step_params(self) -> int:
        """The weights a step reads: the blocks and the LM head (the input embedding is only gathered)."""
        return self.linear_params + self.vocab * self.hidden

    def kv_heads_per_gpu(self, tp: int) -> int:
        """KV heads one GPU holds under tensor parallelism (replicated when there are fewer than GPUs)."""
        return ceil(self.kv_heads / tp)


def _hf(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/config.json"


MODELS = {
    # KVDirect Sec. 5.1
    "mistral-large-2407": ModelShape(88, 12288, 96, 8, 128, 28672, 32768, True, False,
                                     _hf("mistralai/Mistral-Large-Instruct-2407")),
    # CacheOpt Sec. 2 and 5, CaR Sec. IV
    "opt-13b": ModelShape(40, 5120, 40, 40, 128, 20480, 50272, False, True, _hf("facebook/opt-13b")),
    "opt-30b": ModelShape(48, 7168, 56, 56, 128, 28672, 50272, False, True, _hf("facebook/opt-30b")),
    "opt-175b": ModelShape(96, 12288, 96, 96, 128, 49152, 50272, False, True,
                           "OPT paper (Zhang et al. 2022, arXiv:2205.01068) Table 1: 96 layers, 96 heads, "
                           "d_model 12288; the ffn is 4 d_model and the vocabulary OPT's 50272 as in opt-66b's "
                           + _hf("facebook/opt-66b")),
    # LayerKV Sec. 5.1
    "llama-2-7b": ModelShape(32, 4096, 32, 32, 128, 11008, 32000, True, False, _hf("meta-llama/Llama-2-7b-hf")),
    "yi-34b-200k": ModelShape(60, 7168, 56, 8, 128, 20480, 64000, True, False, _hf("01-ai/Yi-34B-200K")),
    "llama-3.1-70b": ModelShape(80, 8192, 64, 8, 128, 28672, 128256, True, False,
                                _hf("meta-llama/Llama-3.1-70B")),
    # only in the profiles' checks against published timings
    "llama-2-13b": ModelShape(40, 5120, 40, 40, 128, 13824, 32000, True, False, _hf("meta-llama/Llama-2-13b-hf")),
    "llama-2-70b": ModelShape(80, 8192, 64, 8, 128, 28672, 32000, True, False, _hf("meta-llama/Llama-2-70b-hf")),
    "qwen1.5-72b": ModelShape(80, 8192, 64, 64, 128, 24576, 152064, True, False, _hf("Qwen/Qwen1.5-72B")),
    "qwen2.5-72b": ModelShape(80, 8192, 64, 8, 128, 29568, 152064, True, False, _hf("Qwen/Qwen2.5-72B-Instruct")),
}
