"""The engine's Prometheus series (docs/observability.md), read when `/metrics` is scraped.

The engine thread never touches prometheus: it bumps plain counters and publishes a fresh
`EngineState` every STATE_EVERY_S while busy and whenever it goes idle (native/engine_loop.py; the vLLM
backend publishes its own state between steps). A scrape reads
that one reference, so all of a scrape's series come from one snapshot, at most STATE_EVERY_S old
and exact once the engine is idle. Every series carries the engine's id and role.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily

from .state import EngineState

QUEUES = ("waiting", "running", "swapped", "pulling", "held_kv", "pushing")


class EngineCollector:
    """A prometheus collector of one engine's state snapshot: the series both backends have (queues, KV
    blocks, preemptions, tokens, the prefix cache's tiers, KV pulls). `snapshot` returns the latest state, replaced whole by the
    engine's thread, never changed in place: the native EngineState or the vLLM backend's."""

    def __init__(self, snapshot: Callable[[], Any], engine_id: str, role: str):
        self.snapshot = snapshot
        self.labels = {"engine": engine_id, "role": role}

    def collect(self) -> Iterator[Metric]:
        state = self.snapshot()
        yield from self._common(state)
        yield from self._transfer(state)

    def _common(self, state: Any) -> Iterator[Metric]:
        yield self._by(GaugeMetricFamily, "kvmesh_engine_queue_requests",
                       "Requests in each queue of the engine (held_kv: prefill role, KV kept for a decode engine)",
                       "queue", {queue: getattr(state, queue) for queue in QUEUES})
        yield self._by(GaugeMetricFamily, "kvmesh_engine_kv_free_blocks",
                       "KV blocks a request could get now, by tier (unused prefix-cache blocks count as free)",
                       "tier", state.free_blocks)
        yield self._by(GaugeMetricFamily, "kvmesh_engine_kv_total_blocks", "KV blocks, by tier", "tier",
                       state.total_blocks)
        yield self._by(CounterMetricFamily, "kvmesh_engine_preemptions",
                       "Requests preempted, by strategy (recompute: KV dropped; swap: KV moved to the cxl tier)",
                       "strategy", state.preemptions)
        yield self._by(CounterMetricFamily, "kvmesh_engine_kv_allocations_grown",
                       "Allocations a request outgrew and got more for, by where from (unallocated KV, the global "
                       "reservation, or reclaimed from others' unused allotments)", "source", state.allocations_grown)
        yield self._by(CounterMetricFamily, "kvmesh_engine_prompt_tokens",
                       "Prompt tokens whose KV this engine computed, or found in its prefix cache (on the vLLM "
                       "backend: or pulled from a prefill engine)", "source",
                       {"computed": state.computed_prompt_tokens, "cached": state.prefix_cache_hit_tokens})
        yield self._one(CounterMetricFamily, "kvmesh_engine_generated_tokens", "Tokens sampled",
                        state.generated_tokens)
        yield self._by(CounterMetricFamily, "kvmesh_engine_prefix_cache_lookup_blocks",
                       "Full prompt blocks looked up in the prefix cache (in all), for each tier the cache holds", "tier",
                       state.prefix_cache_lookup_blocks)
        yield self._by(CounterMetricFamily, "kvmesh_engine_prefix_cache_hit_blocks",
                       "Full prompt blocks found in the prefix cache, by tier", "tier", state.prefix_cache_hit_blocks)
        yield self._by(GaugeMetricFamily, "kvmesh_engine_prefix_cache_nodes",
                       "Prefix-cache nodes (a block in every layer), by the tier they are in", "tier",
                       state.prefix_cache_nodes)
        yield self._by(CounterMetricFamily, "kvmesh_engine_prefix_cache_moved_nodes",
                       "Prefix-cache nodes moved to a tier (cxl: offloaded by CaR, device: reloaded)", "tier",
                       state.prefix_cache_moved_nodes)
        yield self._by(CounterMetricFamily, "kvmesh_engine_prefix_cache_moved_bytes",
                       "KV bytes those moves copied, by the tier moved to (sparsified nodes: only their kept tokens)",
                       "tier", state.prefix_cache_moved_bytes)

    def _transfer(self, state: Any) -> Iterator[Metric]:
        transfer = state.kv_transfer
        yield self._one(CounterMetricFamily, "kvmesh_engine_kv_transfer_bytes",
                        "KV bytes pulled from prefill engines (decode role)", transfer.bytes)
        yield self._one(CounterMetricFamily, "kvmesh_engine_kv_transfer_reads_asked",
                        "Reads a KV pull asked for: contiguous runs of blocks, before coalescing", transfer.pieces)
        yield self._one(CounterMetricFamily, "kvmesh_engine_kv_transfer_reads_posted",
                        "Reads a KV pull posted after coalescing", transfer.reads_posted)
        seconds = SummaryMetricFamily("kvmesh_engine_kv_transfer_seconds",
                                      "KV pulls (count) and their time, first read posted to the prefill side's "
                                      "ACK of COMPLETE (sum)", labels=list(self.labels))
        seconds.add_metric(list(self.labels.values()), count_value=transfer.pulls, sum_value=transfer.seconds)
        yield seconds

    def _by(self, family: type, name: str, help: str, label: str, values: Mapping[str, float]) -> Metric:
        metric = family(name, help, labels=[*self.labels, label])
        for key, value in sorted(values.items()):
            metric.add_metric([*self.labels.values(), key], value)
        return metric

    def _one(self, family: type, name: str, help: str, value: float) -> Metric:
        metric = family(name, help, labels=list(self.labels))
        metric.add_metric(list(self.labels.values()), value)
        return metric


class NativeEngineCollector(EngineCollector):
    """The native engine's series: the common ones, and its CacheOpt, LayerKV and CaR series."""

    def collect(self) -> Iterator[Metric]:
        state: EngineState = self.snapshot()
        yield from self._common(state)
        yield self._by(CounterMetricFamily, "kvmesh_engine_kv_layers_offloaded",
                       "Request layers whose KV LayerKV put in the cxl tier, by why (admitted: kept off the device "
                       "from the start; forecast: moved when free blocks were forecast to run low), and those it "
                       "brought back to the device (restored)", "reason",
                       state.layers_offloaded)
        yield self._one(CounterMetricFamily, "kvmesh_engine_steps", "Iterations of the engine loop that ran the model",
                        state.steps)
        yield from self._transfer(state)
