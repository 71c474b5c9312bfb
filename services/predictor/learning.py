"""The `embedding` predictor inside the service: loaded from `model_path` with the process's encoder,
and refitted on the prompts `/v1/observe` brings. Imported only when a model is configured, since it
needs torch and the encoder.

The service runs every predictor call on one thread of its own (app.py), so the predictors' state is
only ever touched there. A refit snapshots the buffer on that thread, trains on the snapshot in a
second thread while predictions go on with the model in force, then installs the result on the first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

import torch

from kvmesh.policies.length import LengthPredictor
from kvmesh.policies.length.embedding import EmbeddingPredictor, FitReport, fit

from . import model_files
from .encoder import encoder

OnWorker = Callable[..., Awaitable[Any]]  # run a call on the predictor thread


def load(model_path: str, base: LengthPredictor, refit_every: int, threads: int) -> EmbeddingPredictor:
    """The predictor over the model in `model_path`, falling back to `base` for prompts without text;
    it leaves refits to `refit` (they would hold up predictions on the predictor thread)."""
    if threads:
        torch.set_num_threads(threads)
    model, _ = model_files.load(Path(model_path))
    return EmbeddingPredictor(encoder(), model, base=base, refit_every=refit_every, refit_in_observe=False)


async def refit(predictor: EmbeddingPredictor, on_worker: OnWorker, trainer: Executor) -> FitReport:
    """Train on the predictor's buffer in `trainer`, going on from its model, and install the result."""
    embeddings, lengths = await on_worker(predictor.training_set)
    model, report = await asyncio.get_running_loop().run_in_executor(
        trainer, fit, embeddings, lengths, predictor.settings, predictor.model)
    await on_worker(predictor.install, model)
    return report
