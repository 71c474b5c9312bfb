"""kvmesh: distributed, disaggregated LLM serving. See ARCHITECTURE.md for the map."""

__version__ = "0.1.0"
