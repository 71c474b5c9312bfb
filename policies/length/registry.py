"""Length predictors by name, for the predictor service's config; other packages add theirs through
the `kvmesh.policies` entry-point group (entry name `length:NAME`, value a LengthPredictor factory)."""

from __future__ import annotations

from collections.abc import Callable

from .. import plugins
from .predictors import HistoryPredictor, LengthPredictor, OraclePredictor, RLPPredictor, S3Predictor


def embedding(embed: Callable, base: LengthPredictor | None = None, **options: object) -> LengthPredictor:
    """CacheOpt's learned predictor, `embedding.EmbeddingPredictor` (see it for `embed` and the options);
    its module is imported on first use, as it needs torch."""
    from .embedding import EmbeddingPredictor
    return EmbeddingPredictor(embed, base=base, **options)


PREDICTORS: dict[str, Callable[..., LengthPredictor]] = {
    "history": HistoryPredictor,
    "rlp": RLPPredictor,
    "s3": S3Predictor,
    "oracle": OraclePredictor,
    "embedding": embedding,
}

DEFAULT = "history"


def names() -> list[str]:
    """Every predictor `resolve` finds: the built-in ones, then those of installed packages."""
    return plugins.names("length", PREDICTORS)


def resolve(name: str) -> Callable[..., LengthPredictor]:
    """The factory of predictor `name`; call it with the predictor's options to get a fresh one."""
    return plugins.resolve("length", PREDICTORS, name, "length predictor")
