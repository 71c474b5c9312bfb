"""The LayerKV benchmark's workloads (LayerKV 5.1) and what admission would tell the engine of them.

- Fixed lengths (5.2.1, Fig. 4): every prompt of one length, every output of `OUTPUT_LEN` tokens
  (the paper's 512 scaled by 1/4, as its 16k-token contexts are scaled to what the CPU model's
  device tier holds).
- ShareGPT-shaped (5.2.3-5.2.4, Fig. 6-8), synthesised: no data set is downloaded. Lengths are
  log-normal with ShareGPT's published means, 161 prompt and 338 output tokens (vLLM, Kwon et al.
  SOSP 2023, Fig. 11; CacheOpt Table 1), prompts clipped to [4, 2048] (LayerKV 5.1: "from 4 to 2.3K
  tokens"), outputs scaled by 1/4 like the fixed ones and clipped to [4, 248] (991 / 4).

Requests end at their trace length, as if they sampled EOS there (cacheopt_serving.replay).
"""

from __future__ import annotations

import numpy as np

from kvmesh.services.engine.request import Targets

from .cacheopt_traces import TraceRequest
from .workloads import END_ID, FIRST_ID, Lengths

OUTPUT_LEN = 128                                            # LayerKV 5.2.1's 512, scaled by 1/4
SHAREGPT_PROMPT = Lengths(mean=161.0, sigma=1.0, low=4, high=2048)
SHAREGPT_OUTPUT = Lengths(mean=338.0 / 4, sigma=0.8, low=4, high=248)
PREDICTION_NOISE = 0.2    # the predicted median is the true length times U(1 - this, 1 + this)
PREDICTION_RANGE = 0.25   # the predicted range is the median +- this share (its low bound is what Eq. 1 reads)


def fixed(n: int, prompt_len: int, output_len: int = OUTPUT_LEN, seed: int = 0) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    return [TraceRequest("", rng.integers(FIRST_ID, END_ID, prompt_len).tolist(), output_len) for _ in range(n)]


def sharegpt(n: int, seed: int = 0) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    prompts, outputs = SHAREGPT_PROMPT.sample(rng, n), SHAREGPT_OUTPUT.sample(rng, n)
    return [TraceRequest("", rng.integers(FIRST_ID, END_ID, int(p)).tolist(), int(o)) for p, o in zip(prompts, outputs)]


def targets(requests: list[TraceRequest], ttft_slo_ms: float, tpot_slo_ms: float, seed: int = 0) -> list[Targets]:
    """Each request's SLOs (the TBT SLO is the TPOT SLO) and an honest synthetic prediction of its
    output length, as LayerKV 3.1's range classifier would give: a median off the true length by up
    to PREDICTION_NOISE, and a range of +-PREDICTION_RANGE around it."""
    rng = np.random.default_rng(seed)
    out = []
    for request in requests:
        median = max(1, round(request.output_len * rng.uniform(1 - PREDICTION_NOISE, 1 + PREDICTION_NOISE)))
        out.append(Targets(ttft_slo_ms=ttft_slo_ms, tbt_slo_ms=tpot_slo_ms, predicted_output_median=median,
                           predicted_output_low=max(1, round(median * (1 - PREDICTION_RANGE)))))
    return out
