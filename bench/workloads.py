"""Synthetic serving workloads with the shapes of KVDirect's two data sets, scaled to a tiny CPU model.

KVDirect (paper 001, section 5.1) evaluates on:
  - arXiv summarisation: long prompts, short answers; mean prompt 40,642 tokens, mean answer 241;
  - ShareGPT conversations: shorter prompts, long answers; mean prompt 20,471 tokens, mean answer 2,328.
What distinguishes them is the answer-to-prompt ratio: 241 / 40,642 = 0.006 for arXiv and
2,328 / 20,471 = 0.11 for ShareGPT, 19x apart. A 2-core CPU serving the `tiny` preset (2,048-token
context) cannot take 40K-token prompts, so the lengths are scaled down while keeping that contrast:
  - arxiv: prompts of mean 384 tokens (192..768), answers of mean 24 (16..32): ratio 0.0625;
  - sharegpt: prompts of mean 96 tokens (48..160), answers of mean 96 (64..128): ratio 1.0, 16x apart.
Lengths are log-normal (real prompt and answer lengths are right-skewed) with the stated mean, clipped
to the bounds. Prompts are random token ids from a seeded RNG (no data set is downloaded); ids avoid
the special tokens 0..15 and stay below 2,000, inside any vocabulary of 2,048 or more, so the same
prompts also drive another server (`kvmesh bench serve --target URL`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FIRST_ID, END_ID = 16, 2000  # prompt token ids are drawn from [FIRST_ID, END_ID)


@dataclass(frozen=True)
class Lengths:
    """A clipped log-normal length distribution whose unclipped mean is `mean`."""

    mean: float
    sigma: float
    low: int
    high: int

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        median = self.mean / np.exp(self.sigma ** 2 / 2)
        drawn = rng.lognormal(np.log(median), self.sigma, n)
        return np.clip(np.rint(drawn), self.low, self.high).astype(int)


@dataclass(frozen=True)
class WorkRequest:
    """One request of a workload: the prompt as token ids and how many tokens to generate."""

    prompt_ids: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Workload:
    name: str
    prompt: Lengths
    output: Lengths
    paper_prompt_mean: int  # KVDirect section 5.1, what this workload is scaled from
    paper_output_mean: int

    def requests(self, n: int, seed: int) -> list[WorkRequest]:
        """`n` requests, the same for the same seed."""
        rng = np.random.default_rng(seed)
        prompts, outputs = self.prompt.sample(rng, n), self.output.sample(rng, n)
        return [WorkRequest(prompt_ids=rng.integers(FIRST_ID, END_ID, int(p)).tolist(), max_tokens=int(o))
                for p, o in zip(prompts, outputs)]


ARXIV = Workload("arxiv", prompt=Lengths(384, 0.3, 192, 768), output=Lengths(24, 0.2, 16, 32),
                 paper_prompt_mean=40_642, paper_output_mean=241)
SHAREGPT = Workload("sharegpt", prompt=Lengths(96, 0.3, 48, 160), output=Lengths(96, 0.2, 64, 128),
                    paper_prompt_mean=20_471, paper_output_mean=2_328)
WORKLOADS = {w.name: w for w in (ARXIV, SHAREGPT)}
