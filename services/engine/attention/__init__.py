"""Paged attention over the KV pool: a C++ CPU kernel reading blocks in place, and a plain-torch
path for any device (docs/engine.md, "Paged attention kernel")."""

from .paged import backend, paged_attention, write_kv

__all__ = ["backend", "paged_attention", "write_kv"]
