"""The engine step's cost as a function of its batch, and the JSON profiles it is loaded from.

seconds = a + b * prefill_tokens + c * decode_tokens + d * context_tokens, where prefill_tokens are
the tokens computed as prompt (or recomputed) chunks, decode_tokens the requests decoding one token,
and context_tokens the tokens of KV attention reads, summed over the step's tokens: a decode reads
its whole context, a prompt token itself and the tokens before it (engine.chunk_shape). A profile in `sim/profiles/`
holds one (model, hardware, dtype, threads) fit, each coefficient with where it came from."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

PROFILES = Path(__file__).parent / "profiles"
TERMS = ("a", "b", "c", "d")  # the coefficients, in the order of the batch features (1, prefill, decode, context)


@dataclass(frozen=True, slots=True)
class StepCost:
    a: float          # seconds per step, whatever the batch
    b: float = 0.0    # seconds per prefill token
    c: float = 0.0    # seconds per decode token
    d: float = 0.0    # seconds per context token attention reads

    def seconds(self, prefill_tokens: int, decode_tokens: int, context_tokens: int) -> float:
        return self.a + self.b * prefill_tokens + self.c * decode_tokens + self.d * context_tokens


def profile_path(name: str) -> Path:
    """A profile by name (a file in sim/profiles) or by path."""
    path = Path(name)
    return path if path.suffix == ".json" else PROFILES / f"{name}.json"


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.json"))


def load_profile(name: str) -> StepCost:
    path = profile_path(name)
    if not path.exists():
        raise FileNotFoundError(f"no step-cost profile {name!r}; profiles: {', '.join(profile_names()) or 'none'}")
    coefficients = json.loads(path.read_text())["coefficients"]
    return StepCost(**{term: float(coefficients[term]["value"]) for term in TERMS})


def write_profile(path: Path, cost: StepCost, origin: dict[str, str], about: dict, fit: dict) -> None:
    """`origin`: each coefficient's source; `about`: what the profile is of (model, hardware, ...);
    `fit`: how well it fits the measurements it came from."""
    body = {**about, "coefficients": {term: {"value": value, "origin": origin[term]}
                                      for term, value in asdict(cost).items()}, "fit": fit}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(body, indent=2) + "\n")
