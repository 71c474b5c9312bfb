"""A trace of real instructions and the default model's own answer lengths (instruction_lengths.py).

Each request keeps its instruction's text (what the length predictor reads), gets random token ids
of its prompt's length (what the engine computes; a preset model cannot tell them from real ones)
and ends after the tokens SmolLM2-135M-Instruct answered it with, times `output_scale` (the CPU
benches scale outputs as they scale the papers' lengths). The file is split once, by a fixed seed,
into instructions the predictor may learn from and instructions requests are drawn from, so no
served prompt was seen in training.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

import numpy as np

from .workloads import END_ID, FIRST_ID

DATA = Path(__file__).with_name("data")
INSTRUCTIONS = DATA / "instructions.jsonl"          # the instructions (category, text)
LENGTHS = DATA / "instruction_lengths.jsonl"        # line for line, what the model did (instruction_lengths.py)
SERVED_SHARE = 0.25   # of the instructions, held out for serving


@dataclass(frozen=True)
class TraceRequest:
    text: str              # what the length predictor reads
    prompt_ids: list[int]  # what the engine computes
    output_len: int        # when the request ends (its EOS), unknown to the engine


@dataclass(frozen=True)
class Span:
    """The mean and the longest of a trace's lengths, in tokens (what a KV pool is sized by)."""

    mean: float
    high: int


@dataclass(frozen=True)
class InstructionTrace:
    """The file as a bench's trace: served requests from the `serve` part, training requests from the
    `train` part, answer lengths times `output_scale`."""

    output_scale: float = 1.0
    name: str = "instructions"

    def requests(self, n: int | None, seed: int) -> list[TraceRequest]:
        return instruction_trace("serve", n, self.output_scale, seed)

    def training(self, n: int | None, seed: int) -> list[TraceRequest]:
        return instruction_trace("train", n, self.output_scale, seed)

    @cached_property   # read for every request's query: worked out once
    def prompt(self) -> Span:
        lengths = [r["prompt_tokens"] for r in _rows()]
        return Span(float(np.mean(lengths)), max(lengths))

    @cached_property
    def output(self) -> Span:
        lengths = [_scaled(r["output_tokens"], self.output_scale) for r in _rows()]
        return Span(float(np.mean(lengths)), max(lengths))


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@cache
def _rows() -> tuple[dict, ...]:
    rows = [{**instruction, **lengths} for instruction, lengths in zip(read(INSTRUCTIONS), read(LENGTHS), strict=True)]
    order = np.random.default_rng(0).permutation(len(rows))
    return tuple(rows[i] for i in order)


def instructions(part: str) -> tuple[dict, ...]:
    """The `train` or `serve` part of the file (shuffled once, seed 0)."""
    rows = _rows()
    cut = round(SERVED_SHARE * len(rows))
    return {"serve": rows[:cut], "train": rows[cut:]}[part]


def instruction_trace(part: str, n: int | None = None, output_scale: float = 1.0, seed: int = 0) -> list[TraceRequest]:
    """`n` requests drawn without replacement from `part` (all of it when None), in a seeded order."""
    rows = instructions(part)
    rng = np.random.default_rng(seed)
    picked = rng.permutation(len(rows))[:n]
    return [TraceRequest(text=rows[i]["instruction"],
                         prompt_ids=rng.integers(FIRST_ID, END_ID, rows[i]["prompt_tokens"]).tolist(),
                         output_len=_scaled(rows[i]["output_tokens"], output_scale)) for i in picked]


def _scaled(output_tokens: int, output_scale: float) -> int:
    return max(1, round(output_tokens * output_scale))
