"""The native engine: a paged, layer-granular torch engine (see docs/engine.md)."""
