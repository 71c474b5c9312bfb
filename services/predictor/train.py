"""`kvmesh predictor train DATA.jsonl --out DIR`: the `embedding` length predictor (CacheOpt 3.2,
Fig. 10) trained on prompts and their actual output lengths, written where the service's `model_path`
can name it (model_files.py).

DATA.jsonl holds one `{"prompt": str, "output_len": int}` a line (`tenant` and `template` may be
there too and are ignored: the model reads the prompt). The prompts are embedded once, then
`policies.length.embedding.fit` trains in CacheOpt's two steps and measures the model on the
held-out validation split, against the training split's mean length as a baseline.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated

import msgspec
import torch
from msgspec import Meta
from rich.console import Console
from rich.progress import Progress

from kvmesh.libs.messages.predictor import Key, MAX_LENGTH, MAX_PROMPT_CHARS
from kvmesh.policies.length.embedding import MIN_EXAMPLES, FitSettings, fit

from . import model_files
from .encoder import encoder


class Example(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    prompt: Annotated[str, Meta(min_length=1, max_length=MAX_PROMPT_CHARS)]
    output_len: Annotated[int, Meta(ge=0, le=MAX_LENGTH)]
    tenant: Key | None = None
    template: Key | None = None


def read_examples(path: Path) -> list[Example]:
    """The examples of a JSON-lines file (blank lines skipped); ValueError naming the first bad line."""
    decoder = msgspec.json.Decoder(Example)
    examples = []
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    examples.append(decoder.decode(line))
                except msgspec.DecodeError as exc:
                    raise ValueError(f"{path} line {number}: {exc}") from None
    return examples


def train(data: Path, out: Path, *, epochs: int | None = None, validation: float = 0.1, seed: int = 0,
          threads: int = 0) -> dict:
    """Train on `data`, write the model to `out`, and return the training stats written with it.
    `epochs`: passes over the training split in each of the two steps (default FitSettings.steps
    optimiser steps, whatever the data's size). `threads`: torch's thread count (0: its default)."""
    console = Console(soft_wrap=True)
    if threads:
        torch.set_num_threads(threads)
    examples = read_examples(data)
    if len(examples) < MIN_EXAMPLES:
        raise ValueError(f"{data} has {len(examples)} examples; training needs at least {MIN_EXAMPLES}")
    settings = FitSettings(validation=validation, seed=seed)
    if epochs is not None:
        batches = math.ceil(len(examples) * (1 - validation) / settings.batch_size)
        settings = replace(settings, steps=epochs * batches)
    with Progress(console=console) as progress:
        started = time.perf_counter()
        embed = encoder()
        encoding = progress.add_task("embedding prompts", total=len(examples))
        chunks = []
        for at in range(0, len(examples), 256):
            chunks.append(embed([e.prompt for e in examples[at:at + 256]]))
            progress.update(encoding, completed=min(at + 256, len(examples)))
        embeddings = torch.cat(chunks)
        encoded = time.perf_counter()
        training = progress.add_task("training (two steps)", total=2 * settings.steps)
        model, report = fit(embeddings, torch.tensor([e.output_len for e in examples], dtype=torch.float32),
                            settings, progress=lambda done, _: progress.update(training, completed=done))
        trained = time.perf_counter()
    stats = {**asdict(report), "data": str(data), "settings": asdict(settings),
             "encode_seconds": round(encoded - started, 3), "fit_seconds": round(trained - encoded, 3),
             "threads": torch.get_num_threads()}
    model_files.save(out, model, stats)
    console.print(f"validation ({report.validation_examples} of {len(examples)} examples): "
                  f"MAE {report.mae:.1f} tokens vs {report.baseline_mae:.1f} for the mean length; "
                  f"direction accuracy {report.direction_accuracy:.3f}")
    console.print(f"error band log(1 + actual) - log(1 + predicted) in [{report.error_low:.3f}, "
                  f"{report.error_high:.3f}] for {settings.coverage:.0%} of them: (b - a) = "
                  f"{model.error_range(100):.1f} tokens at a prediction of 100")
    console.print(f"loaded the encoder and embedded in {stats['encode_seconds']:.1f} s, trained in {stats['fit_seconds']:.1f} s; "
                  f"model written to {out}")
    return stats


def run(data: Path, out: Path, epochs: int | None, validation: float, seed: int, threads: int) -> int:
    """The CLI's entry: 0 when the model was written, 2 with a message for bad data or options."""
    try:
        train(data, out, epochs=epochs, validation=validation, seed=seed, threads=threads)
    except (OSError, ValueError) as exc:
        print(f"kvmesh predictor train: {exc}", file=sys.stderr)
        return 2
    return 0
