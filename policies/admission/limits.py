"""Admission's limits and default SLOs, with the admission service's defaults (its Config: the
simulator's front door starts from the same; tests/unit/test_admission_policies.py keeps them equal)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    requests_per_s: float = 0.0       # per API key, on average; 0: no limit
    burst: float = 40.0               # per API key, at once
    max_running: int = 64             # requests at the engines at once
    max_queued: int = 4096            # more wait in admission, in arrival order; beyond: refused
    max_wait_s: float | None = 30.0   # the expected wait for a first token that refuses a request without a TTFT SLO
    default_ttft_ms: float | None = None
    default_tbt_ms: float | None = None
