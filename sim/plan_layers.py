"""LayerKV (seeds/003) for the planner's engines: the engine spec that runs its layer-wise offload and
Algorithm 1's SLO-aware admission, derived from what the planner has (a step-cost profile, its engine
spec and KV geometry) where `sim paper layerkv` derives it from a GPU deployment (sim/layer_fits.py):

- the staging area and Eq. 5: kvmesh's defaults (docs/layerkv.md; layer_fits.with_layerkv sets them):
  a staged layer of a step lends at most a quarter of the device tier (`layer_staging_blocks`' half
  the tier, in two halves); Eq. 5's threshold is 10% of the device tier, over 8 stages;
- Eq. 3, T = alpha n (2 n_param + 2 n n_hidden) / FLOPS, is c1 n + c2 n^2: c1 and c2 are the
  least-squares fit, through the origin, of the profile's own whole-prompt prefill steps at
  layer_fits.LENGTHS (each one step of n tokens and nothing else; its fixed cost a and f is what the
  fit cannot say), given as n_param = c1 FLOPS / 2 and n_hidden = c2 FLOPS / 2 with alpha 1 in units
  of FLOPS_UNIT (the profile does not separate a device's FLOPS from a model's size, and Algorithm 1
  reads only their quotient); a negative c2 (a profile whose pairs cost nothing) refits c1 alone;
- Eq. 4, T = beta n 2 (L - x) d n_heads f / bandwidth: L, d, n_heads and f the KV geometry's, the
  bandwidth the cxl tier's device -> cxl copies' (`--swap-gbps`) and beta 1, as layer_fits sets
  them: the simulator's copies take their bytes over that bandwidth, nothing more.
It needs a cxl tier to offload to and the engine's layers to be the geometry's (`--num-layers` equal
to `--kv-geometry`'s layers: a simulated block is then one layer's, as the deployment's are)."""

from __future__ import annotations

import numpy as np

from kvmesh.policies.costs import PrefillCost
from kvmesh.policies.step_shape import chunk_shape

from .engine import EngineSpec
from .layer_fits import LENGTHS, offload_fit, with_layerkv
from .link import KVGeometry
from .step_cost import StepCost

POLICIES = {"prefill_admission": "layerkv", "layer_offload": "layerkv"}  # off: fcfs and none, the defaults
FLOPS_UNIT = 1e18               # Eq. 3's FLOPS: n_param and n_hidden are counted against it


def layered(spec: EngineSpec, geometry: KVGeometry) -> str | None:
    """Why an engine of `spec` cannot run LayerKV's layers; None when it can."""
    if not spec.cxl_blocks:
        return "a cxl tier to offload layers to (--cxl-blocks)"
    if spec.num_layers != geometry.num_layers:
        return f"--num-layers equal to --kv-geometry's {geometry.num_layers} layers (got {spec.num_layers})"
    return None


def layerkv_spec(spec: EngineSpec, cost: StepCost, geometry: KVGeometry) -> EngineSpec:
    """`spec` with LayerKV's staging area, Eq. 5's threshold and horizon, and Eq. 3 and 4's fits."""
    missing = layered(spec, geometry)
    if missing is not None:
        raise ValueError(f"LayerKV's layer offload needs {missing}")
    return with_layerkv(spec, prefill_fit(cost), offload_fit(geometry, spec.swap_out_bytes_per_s))


def prefill_fit(cost: StepCost) -> PrefillCost:
    """Eq. 3's terms from the step cost's whole-prompt prefills (the module's docstring)."""
    n = np.array(LENGTHS, dtype=float)
    timed = np.array([cost.seconds(*chunk_shape(length, 0, length)) for length in LENGTHS])
    (c1, c2), *_ = np.linalg.lstsq(np.stack([n, n * n], axis=1), timed, rcond=None)
    if c2 < 0:
        c1, c2 = float(n @ timed / (n @ n)), 0.0
    return PrefillCost(alpha=1.0, num_params=round(c1 * FLOPS_UNIT / 2), hidden_size=round(c2 * FLOPS_UNIT / 2),
                       flops_per_s=FLOPS_UNIT)
