"""The other steps of a decoder layer, fused: one C++ pass each on CPU (csrc/layer_ops.cpp), the
plain-torch ops anywhere else or with KVMESH_ATTENTION=torch (the same choice as paged.py).

Each matches the torch ops it replaces rounding for rounding: every op's result is rounded to the
tensor's dtype, as torch would, so bf16 runs agree with the torch path.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from .paged import _kernel


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) over the last dim of x [T, H]."""
    kernel = _kernel() if x.is_cpu else None
    if kernel is not None:
        return kernel.rms_norm(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, D] rotated by cos and signed sin [T, 1, D] (models/rope.py); each token's heads
    contiguous, tokens possibly strided (a view of the fused qkv projection)."""
    kernel = _kernel() if x.is_cpu else None
    if kernel is not None:
        return kernel.rotary(x, cos, sin)
    from ..models.rope import apply_rotary  # here: models imports this module

    return apply_rotary(x, cos, sin)


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of gate_up [T, 2I] = [gate | up]."""
    kernel = _kernel() if gate_up.is_cpu else None
    if kernel is not None:
        return kernel.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias, or + residual (not both). bf16 on CPU runs oneDNN on the weight packed
    once for its blocked format: a third less time at decode batch sizes, and the same bits."""
    packed = _packed(weight)
    if residual is None:
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        return F.linear(x, weight, bias)
    if bias is not None:
        raise ValueError("linear: a bias or a residual, not both")
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, None, "add")
    return torch.addmm(residual, x, weight.t())


def _packed(weight: Tensor) -> Tensor | None:
    """weight in oneDNN's packed layout, cached on it and packed again whenever it changes."""
    if weight.dtype != torch.bfloat16 or not weight.is_cpu or not _packing_available():
        return None
    key = (weight.data_ptr(), weight._version)
    cached = getattr(weight, "_kvmesh_packed", None)
    if cached is None or cached[0] != key:
        # the batch size only tunes the layout; any number of rows works
        cached = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16))
        weight._kvmesh_packed = cached
    return cached[1]


def _packing_available() -> bool:
    return _kernel() is not None and _onednn_packing()


@functools.cache
def _onednn_packing() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
