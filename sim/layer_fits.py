"""LayerKV's Eq. 3 and Eq. 4 fits for a simulated engine on a GPU deployment (sim/hardware.py): what
the native engine profiles at start (services/engine/native/layer_profile.py), taken from the
deployment's own step cost and tier instead of timed prefills and copies.

- Eq. 3: FLOPS is the engine's GPUs' dense peak together; alpha is the least-squares fit through
  the origin of the roofline's whole-prompt prefill times at LENGTHS against Eq. 3's.
- Eq. 4: the bandwidth is the tier's device -> cxl copy bandwidth and beta 1: the simulator's copies
  take their bytes over that bandwidth, nothing more.

`with_layerkv` puts them on an engine spec with kvmesh's defaults (docs/layerkv.md) for the staging
area and Eq. 5; the planner (plan_layers.py) derives the same fits from a step-cost profile."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from kvmesh.policies.costs import OffloadCost, PrefillCost
from kvmesh.policies.offload import OffloadParams
from kvmesh.policies.prefill_admission import prefill_time_s
from kvmesh.policies.step_shape import chunk_shape

from .engine import EngineSpec
from .hardware import Deployment
from .link import KVGeometry

LENGTHS = (256, 1024, 4096, 16384)  # prompts the prefill fit is made on
STAGING_SHARE = 0.25            # of the device tier, a staged layer of a step at most (kvmesh's default)
THRESHOLD, HORIZON = 0.1, 8     # Eq. 5: the free share of the device tier, and the stages ahead (its defaults)


def layer_fits(deployment: Deployment) -> tuple[PrefillCost, OffloadCost]:
    cost, geometry = deployment.cost, deployment.geometry
    theory = PrefillCost(alpha=1.0, num_params=cost.model.params, hidden_size=cost.model.hidden,
                         flops_per_s=cost.tp * cost.gpu.peak_flops)
    timed = np.array([cost.seconds(*chunk_shape(n, 0, n)) for n in LENGTHS])
    eq3 = np.array([prefill_time_s(n, theory) for n in LENGTHS])
    prefill = PrefillCost(float(eq3 @ timed / (eq3 @ eq3)), theory.num_params, theory.hidden_size,
                          theory.flops_per_s)
    return prefill, offload_fit(geometry, deployment.tier.from_device_gbs * 1e9)


def offload_fit(geometry: KVGeometry, bandwidth_bytes_per_s: float) -> OffloadCost:
    """Eq. 4 for the KV geometry over the device -> cxl copies' bandwidth, beta 1."""
    return OffloadCost(beta=1.0, num_layers=geometry.num_layers, head_dim=geometry.head_dim,
                       num_kv_heads=geometry.kv_heads, bytes_per_element=geometry.dtype_bytes,
                       bandwidth_bytes_per_s=bandwidth_bytes_per_s)


def with_layerkv(spec: EngineSpec, prefill: PrefillCost, offload: OffloadCost) -> EngineSpec:
    """`spec` with LayerKV's staging area, Eq. 5's threshold and horizon, and Eq. 3 and 4's fits."""
    return replace(spec, staging_cap=int(STAGING_SHARE * spec.device_blocks),
                   offload=OffloadParams(int(THRESHOLD * spec.device_blocks), HORIZON), prefill_cost=prefill,
                   offload_cost=offload)
