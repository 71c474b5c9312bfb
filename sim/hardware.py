"""A paper's deployment: one engine's model on its GPUs, with its NIC and its memory tier, loaded from
a GPU profile in sim/profiles (kind "roofline"). The step cost is sim/roofline.py's; the rest is here:

    kv_capacity_tokens = (memory x gpu_memory_utilization - weights / TP - activation_reserve) / k

per GPU, k one token's KV bytes on one GPU (its share of the KV heads): each GPU holds its heads of
every token, so that is the engine's capacity in tokens. The KV-transfer link is the engine's GPU-NIC
pairs together (KVDirect pairs GPU i with NIC i, and under TP each GPU moves its own heads), so its
bandwidth is TP times one NIC's. The tier is the `cxl` tier of kvmesh's KV model: host memory over
PCIe, or a CXL device; each GPU copies its own KV heads over its own link, so the engine's copy
bandwidth, each direction, is TP times one GPU's (a profile's constants are per GPU)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .engine import EngineSpec
from .link import KVGeometry, LinkSpec
from .model_shapes import MODELS
from .roofline import DTYPE_BYTES, Roofline, from_profile, gpu
from .step_cost import read_profile

GIB = 2**30


@dataclass(frozen=True, slots=True)
class TierLink:
    """Copies between the engine's GPUs and its `cxl` tier, GB/s each way, all GPUs together."""

    name: str                 # what the tier is: host DRAM over PCIe, a CXL device
    to_device_gbs: float      # a load or swap-in
    from_device_gbs: float    # an offload or swap-out

    def swap_rates(self) -> dict[str, float]:
        """As EngineSpec's swap fields, bytes a second each way."""
        return {"swap_out_bytes_per_s": self.from_device_gbs * 1e9, "swap_in_bytes_per_s": self.to_device_gbs * 1e9}


@dataclass(frozen=True, slots=True)
class Deployment:
    name: str
    cost: Roofline
    geometry: KVGeometry
    kv_capacity_tokens: int
    link: LinkSpec
    tier: TierLink
    tp: int
    sources: dict[str, str] = field(default_factory=dict)  # each constant's source, by name

    def engine_spec(self, block_size: int = 16, cxl_blocks: int = 0, **overrides) -> EngineSpec:
        """An EngineSpec with the device blocks the KV capacity gives (blocks of one layer each) and,
        with `cxl_blocks`, a cxl tier that is the deployment's: a swap copies the geometry's block
        bytes at the tier's bandwidth each way (engine-wide already). `overrides` win."""
        blocks = self.kv_capacity_tokens // block_size * self.geometry.num_layers
        tier = {} if not cxl_blocks else {"block_bytes": self.geometry.block_bytes(block_size)} | self.tier.swap_rates()
        return EngineSpec(**({"block_size": block_size, "num_layers": self.geometry.num_layers,
                              "device_blocks": blocks, "cxl_blocks": cxl_blocks} | tier | overrides))


def load_deployment(name: str) -> Deployment:
    """A GPU profile in sim/profiles by name (or path), as load_profile takes it."""
    body = read_profile(name)
    if body.get("kind") != "roofline":
        raise ValueError(f"profile {name!r} is a fitted step cost, not a GPU deployment (kind 'roofline')")
    cost = from_profile(body)
    constants = body["constants"]
    value = _values(constants)
    model = cost.model
    link = LinkSpec(gbps=value["nic_gbs"] * cost.tp, latency_us=value["nic_latency_us"],
                    per_read_us=value["nic_per_read_us"])
    tier = TierLink(body["tier"], value["tier_to_device_gbs"] * cost.tp, value["tier_from_device_gbs"] * cost.tp)
    return Deployment(body["name"], cost, KVGeometry(model.layers, model.kv_heads, model.head_dim, cost.dtype_bytes),
                      kv_capacity_tokens(cost, value), link, tier, cost.tp,
                      {key: entry["source"] for key, entry in constants.items()})


def kv_capacity_tokens(cost: Roofline, value: dict[str, float]) -> int:
    """Tokens of KV one engine holds: what one GPU has left for KV over one token's KV on it."""
    free = value["memory_gib"] * GIB * value["gpu_memory_utilization"] \
        - cost.model.params * cost.dtype_bytes / cost.tp - value["activation_reserve_gib"] * GIB
    return max(0, int(free // cost.kv_bytes_per_token_per_gpu))


def check_value(body: dict, check: dict) -> float:
    """What the model gives for one of a profile's checks against a publication: the profile's
    constants (with the check's overrides, for a GPU variant or a dtype) on the check's model and TP;
    seconds for a step, tokens for a KV capacity, and for a reuse the share of the TTFT saved by
    loading a prompt's KV from the tier (then computing its last token) instead of prefilling it."""
    constants = body["constants"] | check.get("overrides", {})
    cost = Roofline(MODELS[check["model"]], gpu(constants), int(check["tp"]),
                    int(check.get("dtype_bytes", DTYPE_BYTES[body["dtype"]])))
    if check["kind"] == "capacity":
        return float(kv_capacity_tokens(cost, _values(constants)))
    if check["kind"] == "reuse":
        n = int(check["tokens"])
        load = n * cost.kv_bytes_per_token_per_gpu / (_values(constants)["tier_to_device_gbs"] * 1e9)
        return 1 - (load + cost.seconds(1, 0, 0, n)) / cost.seconds(n, 0, 0, n * (n + 1) // 2)
    return cost.seconds(*check["step"])


def _values(constants: dict) -> dict[str, float]:
    return {key: float(entry["value"]) for key, entry in constants.items()}
