"""Workloads: Poisson arrivals with prompt and output lengths fixed or drawn from a distribution,
the same for the same seed; or a measured run's requests replayed as they were sent (`replay`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .request import SimRequest

KINDS = ("fixed", "uniform", "exp", "lognormal")


@dataclass(frozen=True, slots=True)
class Lengths:
    """`N` (fixed), `uniform:LOW-HIGH` (inclusive), `exp:MEAN` (exponential, at least 1) or
    `lognormal:MEAN:SIGMA` (of mean MEAN, its log's standard deviation SIGMA; at least 1)."""

    kind: str
    low: int
    high: int = 0
    sigma: float = 0.0

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
            elif kind == "lognormal":
                mean, _, sigma = rest.partition(":")
                lengths = cls("lognormal", int(mean), sigma=float(sigma))
            else:
                raise ValueError(f"unknown kind {kind!r}")
        except ValueError as exc:
            raise ValueError(f"lengths {text!r}: N, uniform:LOW-HIGH, exp:MEAN or lognormal:MEAN:SIGMA "
                             f"({exc})") from None
        if lengths.low < 1 or (kind == "uniform" and lengths.high < lengths.low) or lengths.sigma < 0:
            raise ValueError(f"lengths {text!r}: must be at least 1, LOW <= HIGH and SIGMA >= 0")
        return lengths

    def __str__(self) -> str:
        """As `parse` reads it."""
        if self.kind == "fixed":
            return str(self.low)
        if self.kind == "uniform":
            return f"uniform:{self.low}-{self.high}"
        return f"exp:{self.low}" if self.kind == "exp" else f"lognormal:{self.low}:{self.sigma:g}"

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.kind == "fixed":
            return [self.low] * n
        if self.kind == "uniform":
            return rng.integers(self.low, self.high + 1, n).tolist()
        if self.kind == "lognormal":  # mu puts the mean at low: E = exp(mu + sigma^2 / 2)
            drawn = rng.lognormal(np.log(self.low) - self.sigma ** 2 / 2, self.sigma, n)
            return np.maximum(1, np.rint(drawn)).astype(int).tolist()
        return np.maximum(1, np.rint(rng.exponential(self.low, n))).astype(int).tolist()


def poisson(rate: float, n: int, prompt: Lengths, output: Lengths, seed: int) -> list[SimRequest]:
    """`n` requests arriving at `rate` a second (exponential gaps), the first at its first gap."""
    if rate <= 0 or n < 1:
        raise ValueError(f"rate must be > 0 and n >= 1, got {rate} and {n}")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, n)).tolist()
    prompts, outputs = prompt.draw(rng, n), output.draw(rng, n)
    return [SimRequest(f"r{i}", t, p, o) for i, (t, p, o) in enumerate(zip(arrivals, prompts, outputs))]


def replay(arrivals: Sequence[float], prompts: Sequence[int], outputs: Sequence[int],
           ids: Sequence[str] | None = None) -> list[SimRequest]:
    """Requests given one by one, as a measured run sent them: arrival times (seconds from the run's
    start), prompt and output lengths in tokens; ids `r0`, `r1`, ... unless given."""
    if not len(arrivals) == len(prompts) == len(outputs) or (ids is not None and len(ids) != len(arrivals)):
        raise ValueError(f"one arrival, prompt and output length (and id) per request; got {len(arrivals)}, "
                         f"{len(prompts)}, {len(outputs)}{'' if ids is None else f' and {len(ids)}'}")
    if any(p < 1 or o < 1 for p, o in zip(prompts, outputs)) or any(t < 0 for t in arrivals):
        raise ValueError("lengths must be at least 1 and arrivals at least 0")
    names = ids if ids is not None else [f"r{i}" for i in range(len(arrivals))]
    return [SimRequest(name, float(t), int(p), int(o)) for name, t, p, o in zip(names, arrivals, prompts, outputs)]
