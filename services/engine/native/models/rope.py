"""Rotary position embeddings (RoFormer, Su et al. 2021) with the context extensions HF Llama supports.

Each rope_type only changes the inverse frequencies `inv_freq` (and, for YaRN, scales cos/sin):

    default  theta^(-2i/d)
    linear   default / factor                                  (position interpolation, Chen et al. 2023)
    llama3   per wavelength band: default, default/factor, or a smooth blend of the two (Llama 3.1)
    yarn     ramp between interpolation and extrapolation, cos/sin times the attention factor (YaRN, Peng et al. 2023)
    dynamic  NTK-aware: theta grows with the current length                          (bloc97 / emozilla)

Numerics follow transformers' modeling_rope_utils.py expression for expression, so logits match it.
The static types cache one [max_position_embeddings, d] table of (cos | sin) halves per device and dtype
and gather rows at the flattened positions; positions must stay below max_position_embeddings.

Dynamic NTK depends on the sequence length, and the model only sees flattened positions, so the rule is:
the length is max(positions) + 1 over the whole forward call (the longest sequence of the batch so far),
and theta is rescaled only when that exceeds max_position_embeddings. This is exactly what a freshly built
transformers model computes for the same batch. (A transformers model instance also keeps a grown
frequency table until the length drops back below the original limit; we stay stateless instead.)
The length stays a tensor, so the dynamic path never synchronises with the device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .config import ModelConfig


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [T, H, D] with cos and signed sin [T, 1, D] from `RotaryEmbedding`.

    This is HF's `x * cos + rotate_half(x) * sin` with rotate_half's negation moved into `sin`, which is
    bitwise the same and saves an op.
    """
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class RotaryEmbedding:
    """cos/sin at arbitrary positions for one model config.

    Not an nn.Module on purpose: its tables are float32 and are cast per dtype, so model.to(bfloat16)
    must not round them.
    """

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.inv_freq, self.attention_factor = inv_freq(config)
        self._tables: dict[tuple[torch.device, torch.dtype], Tensor] = {}
        self._inv_freq_on: dict[torch.device, Tensor] = {}

    def __call__(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and signed sin, [T, 1, head_dim] each, in `dtype`, for the int64 `positions` [T]."""
        if self.config.rope_type == "dynamic":
            halves = self._dynamic_halves(positions).to(dtype)
        else:
            halves = self._table(positions.device, dtype).index_select(0, positions)
        cos, sin = halves.unsqueeze(1).chunk(2, -1)
        return torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)

    def _table(self, device: torch.device, dtype: torch.dtype) -> Tensor:
        table = self._tables.get((device, dtype))
        if table is None:
            positions = torch.arange(self.config.max_position_embeddings, device=device)
            table = _halves(positions, self.inv_freq.to(device), self.attention_factor).to(dtype)
            self._tables[(device, dtype)] = table
        return table

    def _dynamic_halves(self, positions: Tensor) -> Tensor:
        c, device = self.config, positions.device
        if device not in self._inv_freq_on:
            self._inv_freq_on[device] = self.inv_freq.to(device)
        seq_len = positions.max() + 1
        # Up to max_position_embeddings HF keeps the original frequencies, which the NTK formula at that
        # length misses by an ulp; the clamp (HF's too) only keeps that unused branch finite.
        scaled = _ntk_inv_freq(c, seq_len.clamp(min=c.max_position_embeddings))
        inv = torch.where(seq_len > c.max_position_embeddings, scaled, self._inv_freq_on[device])
        return _halves(positions, inv, 1.0)


def inv_freq(config: ModelConfig) -> tuple[Tensor, float]:
    """(inverse frequencies [head_dim / 2] float32 on CPU, attention factor) for the config's rope_type.

    For dynamic NTK these are the frequencies used up to max_position_embeddings.
    """
    rope_type = config.rope_type
    if rope_type == "default":
        return _default_inv_freq(config), 1.0
    if rope_type == "linear":
        return _default_inv_freq(config) / config.rope_scaling["factor"], 1.0
    if rope_type == "dynamic":
        return _ntk_inv_freq(config, config.max_position_embeddings), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(config), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(config)
    raise ValueError(f"unsupported rope_type {rope_type!r}")


def _halves(positions: Tensor, inv_freq: Tensor, attention_factor: float) -> Tensor:
    """[T, head_dim] = (cos | sin) of positions * inv_freq, in float32 as HF computes them."""
    freqs = positions[:, None].float() * inv_freq
    halves = torch.cat((freqs.cos(), freqs.sin()), -1)
    return halves * attention_factor if attention_factor != 1.0 else halves


def _exponents(dim: int, device: torch.device | None = None) -> Tensor:
    """2i / d for i < d / 2."""
    return torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim


def _default_inv_freq(config: ModelConfig) -> Tensor:
    return 1.0 / (config.rope_theta ** _exponents(config.head_dim))


def _ntk_inv_freq(config: ModelConfig, seq_len: int | Tensor) -> Tensor:
    """Dynamic NTK: theta * (factor * L / L_max - (factor - 1)) ^ (d / (d - 2)); L may be a 0-d tensor."""
    dim, max_len, factor = config.head_dim, config.max_position_embeddings, config.rope_scaling["factor"]
    base = config.rope_theta * ((factor * seq_len / max_len) - (factor - 1)) ** (dim / (dim - 2))
    device = seq_len.device if isinstance(seq_len, Tensor) else None
    return 1.0 / (base ** _exponents(dim, device))


def _llama3_inv_freq(config: ModelConfig) -> Tensor:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between."""
    s = config.rope_scaling
    factor, low_freq_factor, high_freq_factor = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context_len = s["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    inv = _default_inv_freq(config)
    wavelen = 2 * math.pi / inv
    inv_llama = torch.where(wavelen > low_freq_wavelen, inv / factor, inv)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth_factor) * inv_llama / factor + smooth_factor * inv_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed, inv_llama)


def _yarn_inv_freq(config: ModelConfig) -> tuple[Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, linear ramp between (YaRN Eq. 18-20)."""
    s, dim, base = config.rope_scaling, config.head_dim, config.rope_theta
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or config.max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:  # YaRN's sqrt(1/t) = 0.1 ln(s) + 1
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):  # DeepSeek's variant
            attention_factor = float(mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]))
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s.get("beta_fast") or 32), correction_dim(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero, as HF does
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** _exponents(dim)
    extrapolation_factor = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_factor) + (1.0 / pos_freqs) * extrapolation_factor
    return inv, attention_factor
