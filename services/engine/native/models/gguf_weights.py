"""Serving a GGUF file's quantised weights as they ship: Q4_1 and Q8_0 blocks read by the engine's
C++ kernels (quant.py) in steps of few tokens, where a step is bound by reading the weights.

A decode step at batch 1 reads every weight once: 268 MB in bf16 for SmolLM2-135M, 96 MB in its
GGUF's Q4_1 layers and Q8_0 embedding (also its LM head). The kernels compute with the exact
dequantised values (d * q + m in float32), so these steps are exact to the shipped model. Steps of
many tokens (prefill chunks) are bound by compute instead and keep the dense weights, which the
checkpoint holds as the same values dequantised (then cast to the engine's dtype).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import Tensor

from ..quant import QuantizedWeight
from .config import ModelConfig

log = logging.getLogger(__name__)

KINDS = {"Q4_1": "q4_1", "Q8_0": "q8_0"}  # GGML type name -> QuantizedWeight kind


def load_gguf_weights(path: Path, config: ModelConfig, device: torch.device | str) -> dict[str, QuantizedWeight] | None:
    """Our fused parameter name -> its quantised weight, read from the GGUF file at `path`, or None
    (logged) when some weight the model multiplies is in a type the kernels do not read."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(path).tensors}

    def weight(name: str, rows: Tensor | None = None) -> QuantizedWeight | None:
        tensor = tensors.get(name)
        kind = KINDS.get(tensor.tensor_type.name) if tensor is not None else None
        if kind is None:
            return None
        k, n = (int(d) for d in tensor.shape)  # GGML lists the contiguous dimension first
        packed = QuantizedWeight.from_gguf_blocks(kind, tensor.data, (n, k))
        return packed.take_rows(rows) if rows is not None else packed

    q_rows = _unpermuted_rows(config.num_heads, config.num_heads * config.head_dim)
    k_rows = _unpermuted_rows(config.num_kv_heads, config.num_kv_heads * config.head_dim)
    found: dict[str, QuantizedWeight | None] = {}
    for i in range(config.num_layers):
        p = f"blk.{i}."
        parts = {"qkv_proj": [weight(p + "attn_q.weight", q_rows), weight(p + "attn_k.weight", k_rows),
                              weight(p + "attn_v.weight")],
                 "o_proj": [weight(p + "attn_output.weight")],
                 "gate_up_proj": [weight(p + "ffn_gate.weight"), weight(p + "ffn_up.weight")],
                 "down_proj": [weight(p + "ffn_down.weight")]}
        for name, pieces in parts.items():
            same_kind = all(x is not None for x in pieces) and len({x.kind for x in pieces}) == 1
            found[f"layers.{i}.{name}"] = QuantizedWeight.cat(pieces) if same_kind else None
    found["lm_head"] = weight("output.weight" if "output.weight" in tensors else "token_embd.weight")
    missing = sorted(name for name, w in found.items() if w is None)
    if missing:
        log.info("%s: %d weights are in types the quantised kernels do not read (e.g. %s); serving dense weights",
                 path.name, len(missing), missing[0])
        return None
    return {name: w.to(device) for name, w in found.items()}  # type: ignore[union-attr]


def _unpermuted_rows(heads: int, rows: int) -> Tensor:
    """Which GGUF row holds each Hugging Face row of a Q or K projection: llama.cpp's converter
    interleaves each head's two rotary halves, and this is the order transformers puts back."""
    half = rows // heads // 2
    return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(rows)
