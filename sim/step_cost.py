"""The engine step's cost as a function of its batch, and the JSON profiles it is loaded from.

seconds = a + b * prefill_tokens + c * decode_tokens + d * decode_context + e * prefill_context
          + f * prefill_sequences + g * staged_bytes,
where prefill_tokens are the tokens computed as prompt (or recomputed) chunks, decode_tokens the
requests decoding one token, decode_context the KV tokens the decodes' attention reads (each its whole
context), prefill_context the (query, key) pairs the chunks' attention computes (each prompt token
with itself and the tokens before it: policies/step_shape.py) and prefill_sequences the prompt
chunks. The two context terms differ in kind: a decode's attention is bound by reading the KV
(bytes), a prefill's by computing the pairs (FLOPs), so on a GPU their costs per token differ by two
orders of magnitude. The chunks' term is what a chunk pays whatever its length (the native engine
runs each new prompt's causal attention apart, in every layer, and samples it): on this CPU a short
prompt costs several times its tokens' share of a long one's, which the token and pair terms cannot
say of 60- and 1536-token prompts together. `staged_bytes` are the KV bytes a LayerKV step copies
through its staging area (an offloaded layer's context loaded, the blocks it wrote written back:
the engine's `GET /v1/steps` records them): on a GPU the copies overlap the compute on a side stream
(staging_time.py times them, g 0), while on a CPU they run inline and a staged layer's attention
reads a step's fresh staging blocks, which FCFS's steps never show (a staged step of bench layerkv
took 1.09-1.21x its shape's cost). A profile in `sim/profiles/`
holds one (model, hardware, dtype, threads) fit, each coefficient with where it came from.

A profile of kind "roofline" (a GPU deployment: sim/roofline.py, sim/hardware.py) is built from
published hardware numbers instead; `load_profile` returns either, both with the same `seconds`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .roofline import Roofline, from_profile

PROFILES = Path(__file__).parent / "profiles"
# The coefficients of: 1, the shape's FIELDS (policies/step_shape.py), the bytes the step staged
TERMS = ("a", "b", "c", "d", "e", "f", "g")


@dataclass(frozen=True, slots=True)
class StepCost:
    a: float          # seconds per step, whatever the batch
    b: float = 0.0    # seconds per prefill token
    c: float = 0.0    # seconds per decode token
    d: float = 0.0    # seconds per KV token a decode's attention reads
    e: float = 0.0    # seconds per (query, key) pair a prefill chunk's attention computes
    f: float = 0.0    # seconds per prompt computed from its first token in the step (a prefill sequence)
    g: float = 0.0    # seconds per KV byte copied through the step's staging area (LayerKV)

    def seconds(self, prefill_tokens: int, decode_tokens: int, decode_context: int, prefill_context: int,
                prefill_sequences: int = 0, staged_bytes: float = 0) -> float:
        """A step's cost; `prefill_sequences` and `staged_bytes` 0 for callers that count none."""
        return self.a + self.b * prefill_tokens + self.c * decode_tokens + self.d * decode_context + \
            self.e * prefill_context + self.f * prefill_sequences + self.g * staged_bytes


def profile_path(name: str) -> Path:
    """A profile by name (a file in sim/profiles) or by path."""
    path = Path(name)
    return path if path.suffix == ".json" else PROFILES / f"{name}.json"


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.json"))


def read_profile(name: str) -> dict:
    path = profile_path(name)
    if not path.exists():
        raise FileNotFoundError(f"no step-cost profile {name!r}; profiles: {', '.join(profile_names()) or 'none'}")
    return json.loads(path.read_text())


def load_profile(name: str) -> StepCost | Roofline:
    """A fitted profile's StepCost (kind "linear", the default) or a GPU profile's Roofline. A term a
    profile lacks is 0 (f and g: profiles fitted before them)."""
    body = read_profile(name)
    if body.get("kind", "linear") == "roofline":
        return from_profile(body)
    coefficients = body["coefficients"]
    return StepCost(**{term: float(coefficients[term]["value"]) for term in TERMS if term in coefficients})


def write_profile(path: Path, cost: StepCost, origin: dict[str, str], about: dict, fit: dict) -> None:
    """`origin`: each coefficient's source; `about`: what the profile is of (model, hardware, ...);
    `fit`: how well it fits the measurements it came from."""
    body = {**about, "coefficients": {term: {"value": value, "origin": origin[term]}
                                      for term, value in asdict(cost).items()}, "fit": fit}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2) + "\n")
