"""What the layer-offload hook reads and decides (LayerKV 3.1.1-3.1.2): how many of a request's
layers keep their KV on the device tier when it is admitted, and which running requests give up
retained layers when the free-block forecast (Eq. 5) runs low."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvmesh.policies.views import PoolView, RequestView

# How a decode gets a request's offloaded layers: "stage", loaded into the staging area every step;
# "restore", moved back to the device once, the decode waiting until they all fit (LayerKV 4).
LayerDecode = Literal["restore", "stage"]


@dataclass(frozen=True, slots=True)
class OffloadParams:
    threshold_blocks: int = 0       # Eq. 5: below this many free device blocks (all layers), offload retained layers
    horizon_stages: int = 8         # how many stages (block_size decode steps each) ahead Eq. 5 is run
    decode_offloaded: LayerDecode = "restore"


@dataclass(frozen=True, slots=True)
class OffloadInput:
    admitting: Sequence[RequestView]   # waiting requests, in admission order
    running: Sequence[RequestView]
    pool: PoolView
    now: float
    params: OffloadParams = OffloadParams()


@dataclass(frozen=True, slots=True)
class OffloadPlan:
    """`retain`: of a waiting request, how many layers keep their KV on the device when it is
    admitted (absent: all). `shrink`: of a running request, how many of its device layers it keeps
    (fewer than it has now); the engine offloads the rest. `restore`: of a running request, how many
    of its offloaded layers come back to the device, so its decodes stop loading them every step
    (with `decode_offloaded` "restore", all of them: it decodes only then)."""

    retain: Mapping[str, int] = field(default_factory=dict)
    shrink: Mapping[str, int] = field(default_factory=dict)
    restore: Mapping[str, int] = field(default_factory=dict)
