"""Length predictors by name, for the predictor service's config; other packages add theirs through
the `kvmesh.policies` entry-point group (entry name `length:NAME`, value a LengthPredictor factory)."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points

from .predictors import HistoryPredictor, LengthPredictor, OraclePredictor, RLPPredictor, S3Predictor

PREDICTORS: dict[str, Callable[..., LengthPredictor]] = {
    "history": HistoryPredictor,
    "rlp": RLPPredictor,
    "s3": S3Predictor,
    "oracle": OraclePredictor,
}

DEFAULT = "history"


def names() -> list[str]:
    """Every predictor `resolve` finds: the built-in ones, then those of installed packages."""
    plugins = [e.name.partition(":")[2] for e in entry_points(group="kvmesh.policies") if e.name.startswith("length:")]
    return [*PREDICTORS, *(n for n in plugins if n not in PREDICTORS)]


def resolve(name: str) -> Callable[..., LengthPredictor]:
    """The factory of predictor `name`; call it with the predictor's options to get a fresh one."""
    if name in PREDICTORS:
        return PREDICTORS[name]
    for entry in entry_points(group="kvmesh.policies"):
        if entry.name == f"length:{name}":
            return entry.load()
    raise KeyError(f"no length predictor named {name!r}; known: {', '.join(PREDICTORS)}")
