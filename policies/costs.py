"""The measured costs the engine hands its policies in `PoolView`, fitted at its start: LayerKV's
prefill (Eq. 3) and offload (Eq. 4) terms, and CacheOpt 3.5's recompute and swap curves with the
sweet spot where they cross. Data and their evaluation only; the policies that read them, and the
fits, live with their papers' modules."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SEARCH_MAX_LEN = float(1 << 24)  # tokens: past any model's context


@dataclass(frozen=True, slots=True)
class PrefillCost:
    """Eq. 3's terms: T_prefill = alpha * seqlen * (2 n_param + 2 seqlen n_hidden) / FLOPS."""

    alpha: float               # empirical correction, fitted from prefills timed at engine start
    num_params: int            # n_param
    hidden_size: int           # n_hidden
    flops_per_s: float         # the device's, measured at engine start


@dataclass(frozen=True, slots=True)
class OffloadCost:
    """Eq. 4's terms, measured at engine start: T_offload = beta * seqlen * 2 (L - x) d n f / bandwidth."""

    beta: float                     # empirical correction, fitted from timed copies
    num_layers: int                 # L
    head_dim: int                   # d_heads
    num_kv_heads: int               # n_heads of the KV (the paper's n_heads; with GQA, the KV heads)
    bytes_per_element: int          # f_precision
    bandwidth_bytes_per_s: float    # device -> cxl, measured


@dataclass(frozen=True, slots=True)
class RecomputeCurve:
    """L_r(S) = a*S^b + k*S + e, in seconds."""

    a: float
    b: float
    k: float
    e: float

    def __call__(self, length):
        return self.a * np.power(length, self.b) + self.k * length + self.e


@dataclass(frozen=True, slots=True)
class SwapCurve:
    """L_s(S) = g*S + d, in seconds."""

    g: float
    d: float

    def __call__(self, length):
        return self.g * length + self.d


@dataclass(frozen=True, slots=True)
class SwapCurves:
    recompute: RecomputeCurve
    swap: SwapCurve
    sweet_spot: float | None   # S_s in tokens; None: recompute is never the slower

    @classmethod
    def of(cls, recompute: RecomputeCurve, swap: SwapCurve) -> SwapCurves:
        return cls(recompute, swap, sweet_spot(recompute, swap))


def sweet_spot(recompute: RecomputeCurve, swap: SwapCurve) -> float | None:
    """The length past which swapping stays faster: the last crossing of L_r and L_s up to
    SEARCH_MAX_LEN; 0.0 when swapping is faster at every length, None when it is not faster at the
    longest."""
    lengths = np.geomspace(1.0, SEARCH_MAX_LEN, 1000)
    slower = recompute(lengths) > swap(lengths)
    if not slower[-1]:
        return None
    if slower.all():
        return 0.0
    last = int(np.flatnonzero(~slower)[-1])
    return _bisect_crossing(lambda s: recompute(s) - swap(s), lengths[last], lengths[last + 1])


def _bisect_crossing(f, lo: float, hi: float) -> float:
    """The root of f between lo (f <= 0) and hi (f > 0), to a relative 1e-12."""
    while hi - lo > 1e-12 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if f(mid) > 0 else (mid, hi)
    return float((lo + hi) / 2)
