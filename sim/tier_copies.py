"""The cxl tier's copies as a fitted profile measured them: `kvmesh sim calibrate` times the native
engine's swaps of a request's KV (BlockManager.swap_out and swap_in, every layer) at a few sizes,
and fits each direction's

    seconds = fixed_s + bytes / bytes_per_s

(sim/fit.py's fit_copy_rate). The profile's `tier` section holds both directions' terms, each with
its origin, and the fit's residuals; the simulator's EngineSpec takes both terms from it
(`swap_out_bytes_per_s`, `swap_out_fixed_s` and the same of `swap_in`; kvmesh/cli.py, where
`--swap-gbps` overrides the bandwidths). A GPU profile's swaps are its deployment's tier's
(sim/hardware.py), bandwidth alone."""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import load_deployment
from .step_cost import read_profile

DIRECTIONS = {"swap_out": "device to cxl", "swap_in": "cxl to device"}


@dataclass(frozen=True, slots=True)
class CopyRate:
    bytes_per_s: float
    fixed_s: float = 0.0  # what a swap costs whatever its size: the copy's calls, one per block

    def seconds(self, nbytes: float) -> float:
        return self.fixed_s + nbytes / self.bytes_per_s


def tier_entry(fitted: dict[str, tuple[CopyRate, dict]], about: str, origin: str) -> dict:
    """The `tier` section of a profile (step_cost.write_profile's `about["tier"]`): each direction's
    bandwidth and fixed cost, with `origin`, and its fit (by direction, as `fitted` gives them)."""
    entry: dict = {"about": about}
    for direction, (rate, _) in fitted.items():
        entry[f"{direction}_bytes_per_s"] = {"value": rate.bytes_per_s, "origin": origin}
        entry[f"{direction}_fixed_s"] = {"value": rate.fixed_s, "origin": origin}
    return entry | {"fit": {direction: fit for direction, (_, fit) in fitted.items()}}


def load_swap_rates(name: str) -> dict[str, float]:
    """A profile's swap rates, as EngineSpec's fields: a fitted profile's measured bandwidths and fixed
    costs (none in one without a `tier` section, fitted before it), a GPU deployment's tier's bandwidths."""
    body = read_profile(name)
    if body.get("kind") == "roofline":
        return load_deployment(name).tier.swap_rates()
    tier = body.get("tier")
    if not isinstance(tier, dict):
        return {}
    fields = [f"{d}_{term}" for d in DIRECTIONS for term in ("bytes_per_s", "fixed_s")]
    return {key: float(tier[key]["value"]) for key in fields if key in tier}
