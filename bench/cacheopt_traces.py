"""Synthetic traces shaped like CacheOpt's Table 1, with prompts whose wording carries their length.

Table 1 (input and output lengths in tokens, avg / min / max):
  Alpaca      19.31 / 9 / 2.47K      58.41 / 13 / 292
  ShareGPT   161.31 / 16 / 3.2K     337.99 / 19 / 991
  BookCorpus 1952.11 / 18 / 461K    681.2 / 32 / 1041   (prompts cut to 2,048 tokens, section 2.1)
Every length is scaled by `SCALE` (1/4) so a 2-core CPU serves them with the `tiny` model, prompts
capped at `PROMPT_CAP` tokens and both at least 4. Lengths are log-normal with the listed mean (the
unclipped mean; clipping to the scaled min and max moves it a little), as real ones are right-skewed.

The learnable signal: each request is one of five tasks whose wording asks for a one-word answer up to
a long essay; its output length is the trace's mean times the task's factor, times log-normal noise
(sigma 0.35), clipped. The factors' mean is 1, so the trace keeps its mean. The prompt text is the
task's phrase, a topic and filler words (the encoder reads the text; the engine gets random token ids
of the sampled prompt length, which it cannot tell from real ones). No data set is downloaded.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .workloads import END_ID, FIRST_ID, Lengths

SCALE = 0.25
PROMPT_CAP = 512
NOISE_SIGMA = 0.35
TASKS = (  # (wording, output length / the trace's mean)
    ("In a word or two, name", 0.2),
    ("Briefly, in one sentence, say", 0.45),
    ("In a short paragraph, describe", 0.85),
    ("Explain step by step and in detail", 1.5),
    ("Write a long, thorough essay about", 2.0),
)
TOPICS = ("the water cycle", "medieval castles", "how vaccines work", "the stock market", "volcanoes",
          "the history of jazz", "black holes", "photosynthesis", "the French revolution", "machine learning",
          "coral reefs", "the printing press", "electric cars", "ancient Rome", "climate change", "chess openings")
FILLER = ("please", "note", "that", "context", "the", "user", "asks", "about", "this", "and", "also", "some",
          "details", "for", "a", "report", "on", "topic", "with", "care")


@dataclass(frozen=True)
class TraceRequest:
    text: str              # what the length predictor reads
    prompt_ids: list[int]  # what the engine computes
    output_len: int        # when the request ends (its EOS), unknown to the engine


@dataclass(frozen=True)
class Trace:
    name: str
    prompt: Lengths
    output: Lengths
    paper: tuple[float, float]  # Table 1's mean input and output lengths

    def requests(self, n: int, seed: int) -> list[TraceRequest]:
        rng = np.random.default_rng(seed)
        prompts = self.prompt.sample(rng, n)
        tasks = rng.integers(0, len(TASKS), n)
        noise = rng.lognormal(-NOISE_SIGMA ** 2 / 2, NOISE_SIGMA, n)
        outputs = np.clip(np.rint(self.output.mean * np.array([TASKS[t][1] for t in tasks]) * noise),
                          self.output.low, self.output.high).astype(int)
        return [TraceRequest(text=_text(TASKS[t][0], int(p), rng), prompt_ids=rng.integers(FIRST_ID, END_ID, int(p)).tolist(),
                             output_len=int(o)) for t, p, o in zip(tasks, prompts, outputs)]


def _text(task: str, prompt_len: int, rng: np.random.Generator) -> str:
    topic = TOPICS[rng.integers(len(TOPICS))]
    filler = " ".join(rng.choice(FILLER, max(0, min(prompt_len, 200) - 6)))  # the encoder reads 256 tokens at most
    return f"{task} {topic}. {filler}".strip()


def _scaled(mean: float, low: float, high: float, sigma: float, cap: int | None = None) -> Lengths:
    top = round(high * SCALE) if cap is None else min(cap, round(high * SCALE))
    return Lengths(mean * SCALE, sigma, max(4, round(low * SCALE)), top)


TRACES = {t.name: t for t in (
    Trace("alpaca", _scaled(19.31, 9, 2470, 0.6, PROMPT_CAP), _scaled(58.41, 13, 292, NOISE_SIGMA), (19.31, 58.41)),
    Trace("sharegpt", _scaled(161.31, 16, 3200, 0.8, PROMPT_CAP), _scaled(337.99, 19, 991, NOISE_SIGMA),
          (161.31, 337.99)),
    Trace("bookcorpus", _scaled(1952.11, 18, 2048, 0.5, PROMPT_CAP), _scaled(681.2, 32, 1041, NOISE_SIGMA),
          (1952.11, 681.2)),
)}
