"""Prefill admission beyond FCFS (policies/admission.py): LayerKV's SLO-aware scheduler and CaR's
priority classes with the Shuffled Window."""

from .car import car, fill_window, reuse_class
from .layerkv import allowed_prefill_s, future_tokens, layerkv, max_prefills, prefill_time_s

__all__ = ["allowed_prefill_s", "car", "fill_window", "future_tokens", "layerkv", "max_prefills",
           "prefill_time_s", "reuse_class"]
