"""A simulated cluster's engines and their roles: `colocated:N` (N `both` engines) or `pd:P:D`
(P prefill and D decode engines), as `kvmesh up --colocated N` or `--prefill P --decode D`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Topology:
    colocated: int = 0
    prefill: int = 0
    decode: int = 0

    @classmethod
    def parse(cls, text: str) -> Topology:
        kind, _, rest = text.partition(":")
        try:
            counts = [int(part) for part in rest.split(":")]
        except ValueError:
            counts = []
        if kind == "colocated" and len(counts) == 1 and counts[0] >= 1:
            return cls(colocated=counts[0])
        if kind == "pd" and len(counts) == 2 and min(counts) >= 1:
            return cls(prefill=counts[0], decode=counts[1])
        raise ValueError(f"topology {text!r}: give colocated:N or pd:P:D, each count at least 1")

    def roles(self) -> dict[str, str]:
        """Engine id -> role, in id order within each role."""
        return {**{f"engine-c{i}": "both" for i in range(self.colocated)},
                **{f"engine-p{i}": "prefill" for i in range(self.prefill)},
                **{f"engine-d{i}": "decode" for i in range(self.decode)}}

    def __str__(self) -> str:
        return f"colocated:{self.colocated}" if self.colocated else f"pd:{self.prefill}:{self.decode}"
