"""A finished request's phases on this engine as trace spans (docs/observability.md), built from
the engine's own timestamps when the last frame leaves: the engine thread never traces.

    colocated (role both): prefill.queue -> prefill.compute -> decode.compute
    prefill role:          prefill.queue -> prefill.compute
    decode role, pull:     decode.queue -> kv.transfer -> decode.compute
    decode role, push:     decode.compute (the KV was written during the prefill)
"""

from __future__ import annotations

from kvmesh.libs.messages.engine import Frame
from kvmesh.observability import tracing


def trace_phases(frame: Frame, engine_id: str, role: str) -> None:
    """Record the phases of the request `frame` finished, as children of the current span."""
    timings = frame.timings
    if timings is None or not tracing.enabled():
        return
    usage = frame.usage
    common = {"kvmesh.request_id": frame.request_id, "kvmesh.engine": engine_id,
              "kvmesh.prompt_tokens": usage.prompt_tokens if usage else 0,
              "kvmesh.cached_tokens": usage.cached_tokens if usage else 0,
              "kvmesh.completion_tokens": usage.completion_tokens if usage else 0}  # this engine's, of the request
    error = f"finished with {frame.finish_reason}" if frame.finish_reason in ("abort", "error") else None
    end = timings.finished or timings.arrival
    if timings.transfer is not None:  # decode role, pulled
        stats = timings.transfer
        pull_start, pull_end = timings.pull_start or timings.arrival, timings.pull_end or end
        tracing.record("decode.queue", timings.arrival, pull_start, common)
        tracing.record("kv.transfer", pull_start, pull_end, {
            **common, "kvmesh.bytes": stats.bytes, "kvmesh.pieces": stats.pieces,
            "kvmesh.reads_posted": stats.reads_posted, "kvmesh.backend": stats.backend, "kvmesh.peer": stats.peer,
            "kvmesh.gbps": stats.bytes / stats.seconds / 1e9 if stats.seconds > 0 else 0.0})
        tracing.record("decode.compute", pull_end, end, common, error)
        return
    if role == "decode":  # pushed: the blocks were filled before the request arrived here
        tracing.record("decode.compute", timings.arrival, end, common, error)
        return
    scheduled = timings.scheduled or end
    first_token = timings.first_token or end
    tracing.record("prefill.queue", timings.arrival, scheduled, common)
    tracing.record("prefill.compute", scheduled, first_token, common, error if role == "prefill" else None)
    if role != "prefill":
        tracing.record("decode.compute", first_token, end, common, error)
