"""Swap or recompute a preempted request's KV (CacheOpt 3.5): profiled times fitted to
L_r(S) = a*S^b + k*S + e (recompute) and L_s(S) = g*S + d (swap), S the sequence length in tokens;
beyond the sweet spot S_s, where L_r(S_s) = L_s(S_s), swapping is the faster.

The engine profiles at start-up: for a spread of lengths (at least 4 distinct, e.g. 16 spaced
geometrically from one block to the model's context) it times a prefill of S tokens (recompute) and a
swap out plus back in of S tokens' KV in every layer (swap), in seconds; `fit_curves` turns those into
`SwapCurves`, which it passes to the policies as `PoolView.swap_curves`. No I/O here: the points are
arguments.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .costs import RecomputeCurve, SwapCurve, SwapCurves
from .preemption import Strategy, swap
from .views import PoolView, RequestView

EXPONENT_RANGE = (1.01, 4.0)   # b: recompute grows faster than linearly (attention), at most ~cubically
EXPONENT_STEP = 0.01


def fit_curves(recompute_lengths: Sequence[float], recompute_seconds: Sequence[float],
               swap_lengths: Sequence[float], swap_seconds: Sequence[float]) -> SwapCurves:
    return SwapCurves.of(fit_recompute(recompute_lengths, recompute_seconds), fit_swap(swap_lengths, swap_seconds))


def fit_swap(lengths: Sequence[float], seconds: Sequence[float]) -> SwapCurve:
    """The line through (length, swap time) points, least relative squares; at least 2 distinct lengths."""
    s, t = _points(lengths, seconds, distinct=2)
    (g, d), _ = _relative_lstsq(np.column_stack([s, np.ones_like(s)]), t)
    return SwapCurve(float(g), float(d))


def fit_recompute(lengths: Sequence[float], seconds: Sequence[float]) -> RecomputeCurve:
    """L_r through (length, recompute time) points, least relative squares; at least 4 distinct lengths.

    For a fixed b the curve is linear in (a, k, e), so: the best b on a grid, refined by golden
    section search between its neighbours, each b solved by linear least squares."""
    s, t = _points(lengths, seconds, distinct=4)
    scale = s.max()
    x = s / scale   # conditioning: x^b and x stay within (0, 1]
    grid = np.arange(EXPONENT_RANGE[0], EXPONENT_RANGE[1] + EXPONENT_STEP / 2, EXPONENT_STEP)
    best = min(grid, key=lambda b: _solve(x, t, b)[1])
    b = _golden_min(lambda b: _solve(x, t, b)[1], max(best - EXPONENT_STEP, EXPONENT_RANGE[0]),
                    min(best + EXPONENT_STEP, EXPONENT_RANGE[1]))
    (a, k, e), _ = _solve(x, t, b)
    return RecomputeCurve(a=float(a / scale**b), b=float(b), k=float(k / scale), e=float(e))


def sweet_spot_strategy(victim: RequestView, pool: PoolView) -> Strategy:
    """CacheOpt 3.5: swap a victim whose KV covers more tokens than the sweet spot (when the cxl tier
    has room), else recompute; without profiled curves, as `swap`."""
    curves = pool.swap_curves
    if curves is None:
        return swap(victim, pool)
    if curves.sweet_spot is None or victim.num_computed <= curves.sweet_spot:
        return "recompute"
    return swap(victim, pool)


def _points(lengths: Sequence[float], seconds: Sequence[float], distinct: int) -> tuple[np.ndarray, np.ndarray]:
    s, t = np.asarray(lengths, dtype=float), np.asarray(seconds, dtype=float)
    if s.ndim != 1 or s.shape != t.shape:
        raise ValueError("lengths and times must be two flat sequences of the same size")
    if not (np.isfinite(s).all() and np.isfinite(t).all()):
        raise ValueError("lengths and times must be finite")
    if (s <= 0).any() or (t <= 0).any():
        raise ValueError("lengths and times must be positive")
    if len(np.unique(s)) < distinct:
        raise ValueError(f"need at least {distinct} distinct lengths, got {len(np.unique(s))}")
    return s, t


def _solve(x: np.ndarray, t: np.ndarray, b: float) -> tuple[np.ndarray, float]:
    """(a, k, e) of the fit for exponent b, and its sum of squared relative residuals."""
    return _relative_lstsq(np.column_stack([np.power(x, b), x, np.ones_like(x)]), t)


def _relative_lstsq(design: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, float]:
    """Coefficients minimising the squared relative residuals, and that sum. Relative, as lengths span
    orders of magnitude: in absolute terms the longest would decide the fit alone, and timing noise
    grows with the time."""
    weighted = design / t[:, None]
    coeffs, *_ = np.linalg.lstsq(weighted, np.ones_like(t), rcond=None)
    residual = weighted @ coeffs - 1.0
    return coeffs, float(residual @ residual)


def _golden_min(f, lo: float, hi: float, tol: float = 1e-10) -> float:
    ratio = (np.sqrt(5) - 1) / 2
    while hi - lo > tol:
        left, right = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if f(left) < f(right):
            hi = right
        else:
            lo = left
    return float((lo + hi) / 2)


