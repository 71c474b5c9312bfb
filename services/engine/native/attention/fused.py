"""The other steps of a decoder layer, fused: one C++ pass each on CPU (csrc/layer_ops.cpp), the
plain-torch ops anywhere else or with KVMESH_ATTENTION=torch (the same choice as paged.py).

Each matches the torch ops it replaces rounding for rounding: every op's result is rounded to the
tensor's dtype, as torch would, so bf16 runs agree with the torch path.

The model resolves the four steps once per forward (`layer_ops`) rather than per call: a step makes
17 of these calls, and the checks that chose the path took ~0.3 us of each (2-4x that inside a step).
The functions below still choose per call, for callers outside the model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ...dtypes import bf16_native
from ..quant import QuantizedWeight
from .paged import _kernel


@dataclass(frozen=True, eq=False)
class QuantizedLinear:
    """A linear weight in two forms (models/gguf_weights.py): its quantised blocks for calls of up to
    `max_tokens` rows of x, which reading the weight bounds, and its dense tensor for more rows."""

    packed: QuantizedWeight
    dense: Tensor
    max_tokens: int


class LayerOps(NamedTuple):
    """The fused steps for one device and dtype (see the functions of the same names below)."""

    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    rotary: Callable[[Tensor, Tensor, Tensor], Tensor]
    silu_mul: Callable[[Tensor], Tensor]
    linear: Callable[..., Tensor]


def layer_ops(x: Tensor, quantized: bool = False, dense: bool = False) -> LayerOps:
    """The implementations that serve tensors like x (its device and dtype) under the backend in force;
    `quantized`: some weights are QuantizedLinear; `dense`: multiply those by their dense weight."""
    kernel = _kernel() if x.is_cpu else None
    ops = TORCH_OPS
    if kernel is not None:
        ops = LayerOps(kernel.rms_norm, kernel.rotary, kernel.silu_mul,
                       _packed_linear if _packs(x.dtype, x.device) else _torch_linear)
    return ops._replace(linear=_either_linear(ops.linear, dense)) if quantized else ops


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)) over the last dim of x [T, H]."""
    return layer_ops(x).rms_norm(x, weight, eps)


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H, D] rotated by cos and signed sin [T, 1, D] (models/rope.py); each token's heads
    contiguous, tokens possibly strided (a view of the fused qkv projection)."""
    return layer_ops(x).rotary(x, cos, sin)


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of gate_up [T, 2I] = [gate | up]."""
    return layer_ops(gate_up).silu_mul(gate_up)


def linear(x: Tensor, weight: Tensor | QuantizedLinear, bias: Tensor | None = None,
           residual: Tensor | None = None, dense: bool = False) -> Tensor:
    """x @ weight.T + bias, or + residual (not both). bf16 on CPU runs oneDNN on the weight packed
    once for its blocked format: a third less time at decode batch sizes, and the same bits."""
    quantized = isinstance(weight, QuantizedLinear)
    return layer_ops(weight.dense if quantized else weight, quantized, dense).linear(x, weight, bias, residual)


def _either_linear(dense_linear: Callable[..., Tensor], dense: bool = False) -> Callable[..., Tensor]:
    """A linear that multiplies a QuantizedLinear's blocks when x has few rows (and not `dense`), else
    its dense weight."""
    def either(x: Tensor, weight: Tensor | QuantizedLinear, bias: Tensor | None = None,
               residual: Tensor | None = None) -> Tensor:
        if type(weight) is QuantizedLinear:
            if dense or x.shape[0] > weight.max_tokens:
                return dense_linear(x, weight.dense, bias, residual)
            y = weight.packed.linear(x, residual)
            return y if bias is None else y + bias
        return dense_linear(x, weight, bias, residual)

    return either


def _torch_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _torch_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    from ..models.rope import apply_rotary  # here: models imports this module

    return apply_rotary(x, cos, sin)


def _torch_silu_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


def _torch_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
    if residual is None:
        return F.linear(x, weight, bias)
    if bias is not None:
        raise ValueError("linear: a bias or a residual, not both")
    return torch.addmm(residual, x, weight.t())


ROW_BUCKET = 32  # see padded_rows


def padded_rows(rows: int, dtype: torch.dtype, device: torch.device | str) -> int:
    """How many rows a step of `rows` tokens runs at. oneDNN builds (JIT-compiles) a primitive for
    every row count it meets (7.8 ms the first time for a 3072x576 matmul of 300 rows, 2.5 ms after),
    and a step's row count changes with its batch. Where bf16 linears run oneDNN's packed path, rows
    past ROW_BUCKET are padded to a multiple of it, so a server meets a few dozen counts, each once.
    The runner pads the step's tokens once (padding each linear's x cost 0.2-2 ms a call at 2,000
    rows: a fifth of a loaded engine's time)."""
    if rows <= ROW_BUCKET or not _packs(dtype, torch.device(device)):
        return rows
    return -(-rows // ROW_BUCKET) * ROW_BUCKET


def _packed_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
    if residual is None:
        return torch.ops.mkldnn._linear_pointwise.default(x, _packed(weight), bias, "none", [], "")
    if bias is not None:
        raise ValueError("linear: a bias or a residual, not both")
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, _packed(weight), None, "add")


TORCH_OPS = LayerOps(_torch_rms_norm, _torch_rotary, _torch_silu_mul, _torch_linear)


def _packed(weight: Tensor) -> Tensor:
    """bf16 CPU weight in oneDNN's packed layout, cached on it and packed again whenever it changes."""
    key = (weight.data_ptr(), weight._version)
    cached = getattr(weight, "_kvmesh_packed", None)
    if cached is None or cached[0] != key:
        # the batch size only tunes the layout; any number of rows works
        cached = (key, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 16))
        weight._kvmesh_packed = cached
    return cached[1]


def _packs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether linears of this dtype on this device run oneDNN on packed weights (_packed_linear)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and _kernel() is not None and _onednn_packing()


@functools.cache
def _onednn_packing() -> bool:
    """oneDNN's bf16 linear needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT; other CPUs take torch's path."""
    return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and bf16_native("cpu")
