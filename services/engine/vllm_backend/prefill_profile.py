"""LayerKV's Eq. 3 prefill cost measured on a vLLM engine at start, for KVMeshScheduler's prefill
admission: the device's FLOPS from a matmul, n_param from the checkpoint, n_hidden from its config,
and alpha fitted through the origin against prefills timed on this very engine (the native engine
profiles its own the same way, services/engine/layer_profile.py)."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from kvmesh.policies.costs import PrefillCost
from kvmesh.policies.prefill_admission import prefill_time_s

from ..timing import fit_through_origin, measure_flops

log = logging.getLogger(__name__)

POINTS = 3


def profile_prefill_cost(engine, model_dir: Path, hidden_size: int, vocab_size: int, dtype: torch.dtype,
                         longest: int, repeats: int) -> PrefillCost | None:
    """On the engine's thread, before it serves: time prefills of POINTS lengths up to `longest`."""
    lengths = sorted({int(n) for n in np.geomspace(16, max(16, longest), POINTS)})
    measured = []
    for length in lengths:
        times = []
        for repeat in range(repeats):
            # tokens no other prompt of the profile starts with: nothing comes from the prefix cache
            prompt = [(length * 31 + repeat * 7 + i) % (vocab_size - 1) + 1 for i in range(length)]
            times.append(_prefill_s(engine, f"kvmesh-profile-{length}-{repeat}", prompt))
        measured.append(float(np.median(times)))
    theory = PrefillCost(alpha=1.0, num_params=_num_params(model_dir), hidden_size=hidden_size,
                         flops_per_s=measure_flops(torch.device("cpu") if not torch.cuda.is_available()
                                                   else torch.device("cuda"), dtype, repeats))
    alpha = fit_through_origin([prefill_time_s(n, theory) for n in lengths], measured)
    log.info("LayerKV prefill cost on vLLM: lengths %s took %s s; alpha %s", lengths, measured, alpha)
    return dataclasses.replace(theory, alpha=alpha) if alpha else None


def _prefill_s(engine, request_id: str, prompt: list[int]) -> float:
    from vllm import SamplingParams

    started = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0.0))
    while not any(output.finished for output in engine.step() if output.request_id == request_id):
        pass
    return time.perf_counter() - started


def _num_params(model_dir: Path) -> int:
    total = 0
    for path in model_dir.glob("*.safetensors"):
        with safe_open(str(path), "pt") as weights:
            total += sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    return total
