"""Prefill admission (the `prefill_admission` hook): in which order waiting requests are offered a
place in the batch. FCFS, LayerKV's SLO-aware scheduler, CaR's priority classes with the Shuffled
Window, and RLP's grouping of like estimated lengths.

Signature: (waiting, running, pool, now) -> request ids, first to admit first. The engine admits in
this order until the token budget, the sequence limit or the KV pool says stop; a policy that leaves
a waiting request out keeps it waiting this step (LayerKV admits only as many prefills as the
decoding requests' TPOT SLOs allow).
"""

from .car import car, fill_window, reuse_class
from .fcfs import fcfs
from .layerkv import allowed_prefill_s, future_tokens, layerkv, max_prefills, prefill_time_s
from .like_lengths import like_lengths

__all__ = ["allowed_prefill_s", "car", "fcfs", "fill_window", "future_tokens", "layerkv", "like_lengths",
           "max_prefills", "prefill_time_s", "reuse_class"]
