"""The LayerKV benchmark's workloads (LayerKV 5.1) and what admission would tell the engine of them.

- Fixed lengths (5.2.1, Fig. 4): every prompt of one length, every output of `OUTPUT_LEN` tokens
  (the paper's 512 scaled by 1/4, as its 16k-token contexts are scaled to what the CPU model's
  device tier holds). Random token ids: a client that sends no text.
- Real instructions (5.2.3-5.2.4, Fig. 6-8, where the paper uses ShareGPT): instruction_trace's
  held-out instructions, their prompts' lengths and the default model's own answer lengths (no data
  set is downloaded; the file ships with the repository).

Requests end at their trace length, as if they sampled EOS there (cacheopt_serving.replay). What
the engine is told of a request's length is what admission tells it in serving: the predictor's
answer (predicted, padded), turned into the range LayerKV reads by admission's own function.
"""

from __future__ import annotations

import numpy as np
import torch

from kvmesh.libs.messages.engine import Targets
from kvmesh.libs.messages.predictor import PredictedLength
from kvmesh.policies.length import LengthQuery, adaptive_confidence
from kvmesh.policies.length.embedding import EmbeddingPredictor, FitSettings, fit
from kvmesh.policies.length.predictors import Prediction
from kvmesh.services.admission.predictor_client import with_predicted_lengths

from .instruction_trace import TraceRequest
from .workloads import END_ID, FIRST_ID

OUTPUT_LEN = 128                                            # LayerKV 5.2.1's 512, scaled by 1/4
TENANT = "layerkv"


def fixed(n: int, prompt_len: int, output_len: int = OUTPUT_LEN, seed: int = 0) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    return [TraceRequest("", rng.integers(FIRST_ID, END_ID, prompt_len).tolist(), output_len) for _ in range(n)]


def trained_predictor(training: list[TraceRequest], embed) -> EmbeddingPredictor:
    """The predictor service's `embedding` predictor after it has seen `training` finish: its model
    fitted on the ones with text, its history base fed every length (the base answers a prompt sent
    as token ids)."""
    predictor = EmbeddingPredictor(embed, refit_every=None)
    with_text = [r for r in training if r.text]
    if with_text:
        model, _ = fit(embed([r.text for r in with_text]),
                       torch.tensor([r.output_len for r in with_text], dtype=torch.float32), FitSettings(seed=0))
        predictor.install(model)
    for request in training:
        predictor.base.observe(_query(request, max(r.output_len for r in training)), request.output_len)
    return predictor


def predict(predictor: EmbeddingPredictor, requests: list[TraceRequest], max_tokens: int, rate: float) -> list[Prediction]:
    """What the predictor service answers for each request arriving at `rate` req/s (Eq. 4's c)."""
    confidence = adaptive_confidence(rate)
    return [predictor.predict(_query(r, max_tokens), confidence) for r in requests]


def targets(predictions: list[Prediction], max_tokens: int, ttft_slo_ms: float, tpot_slo_ms: float) -> list[Targets]:
    """Each request's SLOs (the TBT SLO is the TPOT SLO) and its predicted lengths as admission
    passes them on."""
    slos = Targets(ttft_slo_ms=ttft_slo_ms, tbt_slo_ms=tpot_slo_ms)
    return [with_predicted_lengths(slos, PredictedLength(predicted=p.predicted, direction=p.direction.value,
                                                         padding=p.padding, estimated=p.estimated,
                                                         confidence=p.confidence, predictor="embedding"), max_tokens)
            for p in predictions]


def _query(request: TraceRequest, max_tokens: int) -> LengthQuery:
    return LengthQuery(tenant=TENANT, max_tokens=max_tokens, text=request.text or None)
