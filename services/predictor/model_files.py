"""A trained `embedding` length model on disk, the directory `kvmesh predictor train --out` writes and
the service's `model_path` names: `model.safetensors` (the net's tensors) and `meta.json` (its shape,
its error band, the encoder it was trained on, and how training went)."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from kvmesh.policies.length.embedding import LengthModel

from . import encoder

WEIGHTS = "model.safetensors"
META = "meta.json"


def save(directory: Path, model: LengthModel, training: dict) -> None:
    """Write the model to `directory` (made when missing), with `training` (stats, settings) in its meta."""
    tensors, meta = model.state()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, directory / WEIGHTS)
    meta = {**meta, "encoder": encoder.NAME, "training": training}
    (directory / META).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")


def load(directory: Path) -> tuple[LengthModel, dict]:
    """The model in `directory` and its meta; ValueError when it is not one this encoder can serve."""
    try:
        meta = json.loads((directory / META).read_text())
        tensors = load_file(directory / WEIGHTS)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{directory} holds no readable embedding length model: {exc}") from None
    if meta.get("encoder") != encoder.NAME or meta.get("dim") != encoder.DIM:
        raise ValueError(f"{directory} was trained on encoder {meta.get('encoder')!r} of dim {meta.get('dim')}, "
                         f"this service embeds with {encoder.NAME!r} of dim {encoder.DIM}")
    return LengthModel.from_state(tensors, meta), meta
