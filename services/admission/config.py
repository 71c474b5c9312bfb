"""Admission's configuration: where the scheduler and the predictor are, the API keys, the limits, the
SLOs and the timeouts (a `[admission]` table, or KVMESH_ADMISSION_* variables)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from kvmesh.libs.controlplane import ServiceConfig

from .slo import SloClass


class Config(ServiceConfig, kw_only=True):
    port: int = 8100
    scheduler_url: str = "http://127.0.0.1:8102"
    # The length predictor (CacheOpt): each request's output length to allocate for goes to the
    # engines; none configured, or one that fails or takes longer than predict_timeout_s: no prediction.
    predictor_url: str | None = None
    predict_timeout_s: float = 0.5
    # API keys: `api_key` (KVMESH_API_KEY), `api_keys`, and `api_key_file` (one key a line, `#` comments)
    # all count. With none, every public request is refused: admission is never open by default.
    api_key: str | None = None
    api_keys: list[str] = []
    api_key_file: str | None = None
    # A tenant's limit, off unless set: a per-key limit on by default refused most of a benchmark
    # client's burst (vLLM's sends every prompt at once) on a cluster with room to queue it.
    requests_per_s: float = 0.0         # per API key, on average; 0: no limit
    burst: float = 40.0                 # per API key, at once
    max_running: int = 64               # requests at the engines at once
    max_queued: int = 4096              # more wait in admission, in arrival order; beyond: 429
    queue_retry_after_s: float = 1.0
    # Overload: a request that can expect to wait longer than its TTFT SLO, or than this without one,
    # behind the requests ahead of it for their first tokens gets a 429 (Backlog in limits.py); None: no bound.
    max_wait_s: float | None = 30.0
    default_ttft_ms: float | None = None
    default_tbt_ms: float | None = None
    slo_classes: dict[str, SloClass] = {}  # by name: a request's `slo_class` gives its default SLOs
    max_retries: int = 2                # engines tried again when one fails before the first token
    transfer_mode: Literal["pull", "push"] = "pull"  # how KV moves prefill -> decode (KVDirect 4.3)
    route_timeout_s: float = 5.0        # a scheduler call
    scheduler_wait_s: float = 10.0      # a scheduler that does not answer (restarting) is asked again this long
    connect_timeout_s: float = 5.0      # connecting to an engine
    stall_timeout_s: float = 300.0      # an engine that sends no frame for this long has failed
    # A streaming client that takes none of its answer for this long (it never reads) is gone: the
    # request is aborted on its engines and its slot freed, rather than held for as long as it sits.
    client_write_timeout_s: float = 30.0
    models_refresh_s: float = 1.0       # how stale the list of served models may be

    def __post_init__(self) -> None:
        self.keys()  # an unreadable key file is a configuration error, reported at start

    def keys(self) -> list[str]:
        keys = [k for k in [self.api_key, *self.api_keys] if k]
        if self.api_key_file:
            try:
                lines = Path(self.api_key_file).read_text().splitlines()
            except OSError as exc:
                raise ValueError(f"cannot read api_key_file {self.api_key_file}: {exc}") from None
            keys += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        return keys
