"""LayerKV's Eq. 3 and Eq. 4 fits for a simulated engine on a GPU deployment (sim/hardware.py): what
the native engine profiles at start (services/engine/native/layer_profile.py), taken from the
deployment's own step cost and tier instead of timed prefills and copies.

- Eq. 3: FLOPS is the engine's GPUs' dense peak together; alpha is the least-squares fit through
  the origin of the roofline's whole-prompt prefill times at LENGTHS against Eq. 3's.
- Eq. 4: the bandwidth is the tier's device -> cxl copy bandwidth and beta 1: the simulator's copies
  take their bytes over that bandwidth, nothing more."""

from __future__ import annotations

import numpy as np

from kvmesh.policies.costs import OffloadCost, PrefillCost
from kvmesh.policies.prefill_admission import prefill_time_s
from kvmesh.policies.step_shape import chunk_shape

from .hardware import Deployment

LENGTHS = (256, 1024, 4096, 16384)  # prompts the prefill fit is made on


def layer_fits(deployment: Deployment) -> tuple[PrefillCost, OffloadCost]:
    cost, geometry = deployment.cost, deployment.geometry
    theory = PrefillCost(alpha=1.0, num_params=cost.model.params, hidden_size=cost.model.hidden,
                         flops_per_s=cost.tp * cost.gpu.peak_flops)
    timed = np.array([cost.seconds(*chunk_shape(n, 0, n)) for n in LENGTHS])
    eq3 = np.array([prefill_time_s(n, theory) for n in LENGTHS])
    prefill = PrefillCost(float(eq3 @ timed / (eq3 @ eq3)), theory.num_params, theory.hidden_size,
                          theory.flops_per_s)
    offload = OffloadCost(beta=1.0, num_layers=geometry.num_layers, head_dim=geometry.head_dim,
                          num_kv_heads=geometry.kv_heads, bytes_per_element=geometry.dtype_bytes,
                          bandwidth_bytes_per_s=deployment.tier.from_device_gbs * 1e9)
    return prefill, offload
