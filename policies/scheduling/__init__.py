"""Prefill admission beyond FCFS (policies/admission.py): LayerKV's SLO-aware scheduler."""

from .layerkv import PrefillCost, allowed_prefill_s, future_tokens, layerkv, max_prefills, prefill_time_s

__all__ = ["PrefillCost", "allowed_prefill_s", "future_tokens", "layerkv", "max_prefills", "prefill_time_s"]
