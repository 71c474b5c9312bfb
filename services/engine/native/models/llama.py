"""CausalLM: the Llama decoder (also Qwen2 and Mistral) over tokens flattened across sequences.

The model is stateless: each layer hands q, k, v of the step's T tokens to the `attention` callable,
which owns the KV cache (docs/engine.md, "Attention call"). Per-op overhead dominates small models, so a
layer makes nine compute calls besides attention, the elementwise ones fused (attention/fused.py: one C++
pass each on CPU): RMSNorm, one qkv matmul, rotary on q and k together, o_proj fused with the residual
add, RMSNorm, one gate/up matmul, SiLU-and-mul, and down_proj fused with the residual add.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention.fused import LayerOps, QuantizedLinear, layer_ops, linear
from ..quant import QuantizedWeight
from .config import ModelConfig
from .rope import RotaryEmbedding

# attention(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
Attention = Callable[[int, Tensor, Tensor, Tensor], Tensor]


def _parameter(*shape: int, device: torch.device | str | None, dtype: torch.dtype | None) -> nn.Parameter:
    """Uninitialised and frozen: the engine only runs inference."""
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class DecoderLayer(nn.Module):
    """Pre-norm block: h += o_proj(attention(rope(q, k), v)) on norm(h); h += down(silu(gate) * up) on norm(h)."""

    def __init__(self, config: ModelConfig, index: int, device: torch.device | str | None,
                 dtype: torch.dtype | None) -> None:
        super().__init__()
        self.index = index
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size, self.kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.intermediate_size = config.intermediate_size
        self.eps = config.rms_norm_eps
        self.qkv_split = [self.q_size + self.kv_size, self.kv_size]  # qkv -> (q and k, v)
        self.head_split = [self.num_heads, self.num_kv_heads]     # rotated qk -> (q, k)
        hidden, qkv = config.hidden_size, self.q_size + 2 * self.kv_size

        param = partial(_parameter, device=device, dtype=dtype)
        self.input_layernorm = param(hidden)
        self.qkv_proj = param(qkv, hidden)
        self.qkv_bias = param(qkv) if config.attention_bias else None
        self.o_proj = param(hidden, self.q_size)
        self.o_bias = param(hidden) if config.o_proj_bias else None
        self.post_attention_layernorm = param(hidden)
        self.gate_up_proj = param(2 * config.intermediate_size, hidden)
        self.down_proj = param(hidden, config.intermediate_size)
        # What forward multiplies by: the parameters, or QuantizedLinear in place of the projections.
        self.weights: dict[str, Tensor | QuantizedLinear] = self._parameters

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, attention: Attention, ops: LayerOps) -> Tensor:
        t = h.shape[0]
        # Plain dict reads: nn.Module's __getattr__ costs ~0.5 us a parameter, six a layer. The
        # optional biases, when None, are ordinary attributes.
        w = self.weights
        qkv = ops.linear(ops.rms_norm(h, w["input_layernorm"], self.eps), w["qkv_proj"], self.qkv_bias)
        qk, v = qkv.split_with_sizes(self.qkv_split, -1)  # Tensor.split's Python wrapper costs 2 us more
        # q and k are adjacent in qkv, so one rotary pass covers both
        q, k = ops.rotary(qk.view(t, -1, self.head_dim), cos, sin).split_with_sizes(self.head_split, 1)
        o = attention(self.index, q, k, v.view(t, self.num_kv_heads, self.head_dim))
        h = ops.linear(o.reshape(t, self.q_size), w["o_proj"], residual=h)
        if self.o_bias is not None:
            h = h + self.o_bias
        gate_up = ops.linear(ops.rms_norm(h, w["post_attention_layernorm"], self.eps), w["gate_up_proj"])
        return ops.linear(ops.silu_mul(gate_up), w["down_proj"], residual=h)

    def hf_names(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """Our parameter -> the Hugging Face tensors concatenated (along dim 0) into it, with their rows."""
        p = f"model.layers.{self.index}."
        a, m = p + "self_attn.", p + "mlp."
        hidden, inter = self.o_proj.shape[0], self.intermediate_size
        qkv_rows = (self.q_size, self.kv_size, self.kv_size)
        names = {
            "input_layernorm": ((p + "input_layernorm.weight", hidden),),
            "qkv_proj": tuple((f"{a}{x}_proj.weight", rows) for x, rows in zip("qkv", qkv_rows)),
            "o_proj": ((a + "o_proj.weight", hidden),),
            "post_attention_layernorm": ((p + "post_attention_layernorm.weight", hidden),),
            "gate_up_proj": ((m + "gate_proj.weight", inter), (m + "up_proj.weight", inter)),
            "down_proj": ((m + "down_proj.weight", hidden),),
        }
        if self.qkv_bias is not None:
            names["qkv_bias"] = tuple((f"{a}{x}_proj.bias", rows) for x, rows in zip("qkv", qkv_rows))
        if self.o_bias is not None:
            names["o_bias"] = ((a + "o_proj.bias", hidden),)
        return names


class CausalLM(nn.Module):
    """Llama / Qwen2 / Mistral decoder-only LM. Holds no KV state and knows nothing of pools."""

    def __init__(self, config: ModelConfig, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        """Allocates uninitialised parameters; fill them with `load_hf_state_dict`."""
        super().__init__()
        self.config = config
        vocab, hidden = config.vocab_size, config.hidden_size
        self.embed_tokens = _parameter(vocab, hidden, device=device, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, i, device, dtype) for i in range(config.num_layers))
        self.norm = _parameter(hidden, device=device, dtype=dtype)
        self.lm_head = None if config.tie_word_embeddings else _parameter(vocab, hidden, device=device, dtype=dtype)
        self.rotary = RotaryEmbedding(config)
        self.head: Tensor | QuantizedLinear | None = None  # set by use_quantized; else the parameter

    def use_quantized(self, weights: Mapping[str, QuantizedWeight], max_tokens: Mapping[str, int]) -> None:
        """Multiply steps of up to `max_tokens[kind]` tokens by these quantised weights (gguf_weights.py),
        keyed by our parameter names ("layers.0.qkv_proj", "lm_head"); longer ones keep the dense."""
        params = dict(self.named_parameters())
        for layer in self.layers:
            layer.weights = dict(layer._parameters)
        for name, packed in weights.items():
            dense = self.embed_tokens if name == "lm_head" and self.lm_head is None else params[name]
            if tuple(dense.shape) != packed.shape:
                raise ValueError(f"{name}: quantised weight {packed.shape}, the model's {tuple(dense.shape)}")
            quantized = QuantizedLinear(packed, dense, max_tokens[packed.kind])
            if name == "lm_head":
                self.head = quantized
            else:
                _, index, attribute = name.split(".")
                self.layers[int(index)].weights[attribute] = quantized
    def forward(self, input_ids: Tensor, positions: Tensor, attention: Attention, dense: bool = False,
                after_layer: Callable[[int], None] | None = None) -> Tensor:
        """Final-normed hidden states [T, hidden] of T tokens flattened across sequences.

        `positions` [T] (int64) is each token's position in its own sequence, below
        max_position_embeddings unless rope is dynamic NTK. Each layer calls
        `attention(layer, q, k, v)` with rotary applied to q and k; q, k and v are views into the
        layer's fused projection (last dim contiguous, rows strided), so a kernel that needs dense
        tensors must call .contiguous() itself. `after_layer`, if given, is called with each
        layer's index once that layer's KV is written (push mode sends it on from there). `dense`:
        multiply by the dense weights even where quantised blocks would serve (use_quantized).
        """
        h = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary(positions, h.dtype)
        ops = layer_ops(h, quantized=self.head is not None, dense=dense)
        for index, layer in enumerate(self.layers):
            h = layer(h, cos, sin, attention, ops)
            if after_layer is not None:
                after_layer(index)
        return ops.rms_norm(h, self.norm, self.config.rms_norm_eps)

    def logits(self, hidden: Tensor, dense: bool = False) -> Tensor:
        """[N, hidden] -> [N, vocab] float32 (the matmul runs in the model's dtype); `dense` as in forward."""
        head = self.head if self.head is not None else self.embed_tokens if self.lm_head is None else self.lm_head
        return linear(hidden, head, dense=dense).float()

    def hf_names(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """Our parameter name -> ((Hugging Face tensor name, rows), ...) concatenated into it along dim 0."""
        hidden, vocab = self.config.hidden_size, self.config.vocab_size
        names = {"embed_tokens": (("model.embed_tokens.weight", vocab),), "norm": (("model.norm.weight", hidden),)}
        if self.lm_head is not None:
            names["lm_head"] = (("lm_head.weight", vocab),)
        for i, layer in enumerate(self.layers):
            names.update({f"layers.{i}.{ours}": theirs for ours, theirs in layer.hf_names().items()})
        return names

    @torch.no_grad()
    def load_hf_state_dict(self, tensors: Mapping[str, Tensor]) -> None:
        """Copy a Hugging Face state dict in (any device or dtype), fusing q/k/v and gate/up.

        Tied models take lm_head from embed_tokens; a stored lm_head.weight must then equal it.
        Raises KeyError naming missing tensors and ValueError for wrong shapes or unknown tensors.
        """
        names = self.hf_names()
        wanted = {name for parts in names.values() for name, _ in parts}
        missing = sorted(wanted - tensors.keys())
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors the config needs, e.g. {missing[:4]}")
        ignored = {"lm_head.weight"} if self.lm_head is None else set()
        if ignored and "lm_head.weight" in tensors and not tensors["lm_head.weight"].equal(
                tensors["model.embed_tokens.weight"]):
            # transformers would silently untie them; we would rather say so
            raise ValueError("config.json ties word embeddings but lm_head.weight differs from the embeddings; "
                             "set tie_word_embeddings to false")
        unexpected = sorted(n for n in tensors.keys() - wanted - ignored if not n.endswith("rotary_emb.inv_freq"))
        if unexpected:
            raise ValueError(f"checkpoint has {len(unexpected)} tensors this model does not use, "
                             f"e.g. {unexpected[:4]}; does config.json match the weights?")
        params = dict(self.named_parameters())
        for ours, parts in names.items():
            param = params[ours]
            for name, rows in parts:
                shape, expected = tuple(tensors[name].shape), (rows, *param.shape[1:])
                if shape != expected:
                    raise ValueError(f"{name}: checkpoint shape {shape}, config implies {expected}")
            param.copy_(torch.cat([tensors[name] for name, _ in parts]) if len(parts) > 1 else tensors[parts[0][0]])

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The inverse of `load_hf_state_dict`: our parameters split back into Hugging Face tensors (views)."""
        params = dict(self.named_parameters())
        return {name: tensor for ours, parts in self.hf_names().items()
                for (name, _), tensor in zip(parts, params[ours].split([rows for _, rows in parts]))}
