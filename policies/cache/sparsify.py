"""CaR's quality-aware sparsification (III-D): how much of each layer's KV a cached node keeps when
it moves to the cxl tier, and which of its tokens.

Attention is sparser deeper in a model (CaR Fig. 4: with scores under 1% of their row's maximum
taken as zero, ~60% in the first layer rising to ~95%), so each layer keeps the share of its
scores that are not negligible, never less than a floor; the tokens kept are those the attention
scored highest. Whether a set of ratios is acceptable is measured, not assumed: the engine checks
the change in next-token log-likelihood it causes on held-out prompts against a bound, and relaxes
the ratios (`relaxed`) until it holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

NEGLIGIBLE = 0.01  # a score under this share of its row's maximum counts as zero (CaR Fig. 4)
MAX_RELAXATIONS = 4  # profiled ratios halve what they drop at most this often before staying dense


def keep_ratios(sparsity: Sequence[float], floor: float) -> list[float]:
    """Per layer, the share of tokens to keep: what is not sparse, at least `floor`."""
    if not 0 < floor <= 1:
        raise ValueError(f"the keep floor must be in (0, 1], got {floor}")
    if any(not 0 <= s <= 1 for s in sparsity):
        raise ValueError(f"sparsity is a share in [0, 1], got {list(sparsity)}")
    return [max(floor, 1.0 - s) for s in sparsity]


def relaxed(ratios: Sequence[float]) -> list[float]:
    """The ratios with half of what each drops kept again: one step back towards dense KV."""
    return [1.0 - (1.0 - r) / 2 for r in ratios]


def within_bound(ratios: Sequence[float], cost_of: Callable[[list[float]], float],
                 bound: float) -> tuple[list[float], float, int]:
    """The profiled `ratios`, relaxed until `cost_of` them is at most `bound` (at most
    MAX_RELAXATIONS times; past that, every layer keeps everything, at no cost): (ratios, their
    cost, relaxations)."""
    ratios = list(ratios)
    for relaxations in range(MAX_RELAXATIONS + 1):
        cost = cost_of(ratios)
        if cost <= bound:
            return ratios, cost, relaxations
        ratios = relaxed(ratios)
    return [1.0] * len(ratios), 0.0, MAX_RELAXATIONS


def keep_tokens(ratios: Sequence[float], block_size: int) -> list[int]:
    """Per layer, how many of a block's `block_size` tokens to keep (rounded up, at least one)."""
    if any(not 0 < r <= 1 for r in ratios):
        raise ValueError(f"keep ratios must be in (0, 1], got {list(ratios)}")
    return [max(1, min(block_size, math.ceil(r * block_size - 1e-9))) for r in ratios]


def kept_slots(scores: Sequence[float], keep: int) -> list[int]:
    """The positions of the `keep` highest scores, in order; ties go to the later token (the more
    recent context)."""
    ranked = sorted(range(len(scores)), key=lambda i: (scores[i], i), reverse=True)
    return sorted(ranked[:keep])
