"""The CPU kernels of the engine, each with a plain-torch path for any device: paged attention over
the KV pool, reading blocks in place (docs/engine.md, "Paged attention kernel"), and the fused
elementwise steps of a decoder layer (fused.py)."""

from .paged import StepAttention, backend, paged_attention, write_kv

__all__ = ["StepAttention", "backend", "paged_attention", "write_kv"]
