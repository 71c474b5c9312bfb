"""kvmesh's own torch engine: every paper mechanism, on any device (docs/engine.md)."""
