"""Timing and fitting what both backends profile at start: the median of a few runs, a device's
FLOPS from a matmul, and a least-squares slope through the origin (LayerKV's alpha and beta)."""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)

MATMUL = 512  # the FLOPS probe's square matrices


def median_seconds(repeats: int, device: torch.device, work: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def measure_flops(device: torch.device, dtype: torch.dtype, repeats: int) -> float:
    """The device's FLOPS in `dtype`, from a square matmul (the median of `repeats`)."""
    a = torch.randn(MATMUL, MATMUL, device=device, dtype=dtype)
    b = torch.randn(MATMUL, MATMUL, device=device, dtype=dtype)
    torch.matmul(a, b)  # warm up
    seconds = median_seconds(repeats, device, lambda: torch.matmul(a, b))
    return 2 * MATMUL ** 3 / seconds


def fit_through_origin(theory: Sequence[float], measured: Sequence[float]) -> float | None:
    """The k minimising sum (measured - k * theory)^2; None if it is not positive."""
    x, y = np.asarray(theory, dtype=float), np.asarray(measured, dtype=float)
    denominator = float(x @ x)
    k = float(x @ y) / denominator if denominator > 0 else 0.0
    if not k > 0 or not np.isfinite(k):
        log.warning("LayerKV profile: no fit (%s against %s)", list(measured), list(theory))
        return None
    return k
