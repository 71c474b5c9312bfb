"""Workloads: Poisson arrivals with prompt and output lengths fixed or drawn from a distribution,
the same for the same seed."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .request import SimRequest

KINDS = ("fixed", "uniform", "exp")


@dataclass(frozen=True, slots=True)
class Lengths:
    """`N` (fixed), `uniform:LOW-HIGH` (inclusive) or `exp:MEAN` (exponential, at least 1)."""

    kind: str
    low: int
    high: int = 0

    @classmethod
    def parse(cls, text: str) -> Lengths:
        kind, _, rest = text.partition(":") if ":" in text else ("fixed", "", text)
        try:
            if kind == "fixed":
                lengths = cls("fixed", int(rest))
            elif kind == "uniform":
                low, _, high = rest.partition("-")
                lengths = cls("uniform", int(low), int(high))
            elif kind == "exp":
                lengths = cls("exp", int(rest))
            else:
                raise ValueError(f"unknown kind {kind!r}")
        except ValueError as exc:
            raise ValueError(f"lengths {text!r}: N, uniform:LOW-HIGH or exp:MEAN ({exc})") from None
        if lengths.low < 1 or (kind == "uniform" and lengths.high < lengths.low):
            raise ValueError(f"lengths {text!r}: must be at least 1, and LOW <= HIGH")
        return lengths

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            return [self.low] * n
        if self.kind == "uniform":
            return rng.integers(self.low, self.high + 1, n).tolist()
        return np.maximum(1, np.rint(rng.exponential(self.low, n))).astype(int).tolist()


def poisson(rate: float, n: int, prompt: Lengths, output: Lengths, seed: int) -> list[SimRequest]:
    """`n` requests arriving at `rate` a second (exponential gaps), the first at its first gap."""
    if rate <= 0 or n < 1:
        raise ValueError(f"rate must be > 0 and n >= 1, got {rate} and {n}")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, n)).tolist()
    prompts, outputs = prompt.draw(rng, n), output.draw(rng, n)
    return [SimRequest(f"r{i}", t, p, o) for i, (t, p, o) in enumerate(zip(arrivals, prompts, outputs))]
