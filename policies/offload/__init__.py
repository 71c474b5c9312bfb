"""Layer offload: which layers of a request's KV stay on the device tier (LayerKV). `plan` has the contract."""

from .layerkv import decodes_next, forecast_free_blocks, interleaved, layerkv, none, offload_time_s, retained_layers
from .plan import LayerDecode, OffloadInput, OffloadParams, OffloadPlan

__all__ = ["LayerDecode", "OffloadInput", "OffloadParams", "OffloadPlan", "decodes_next", "forecast_free_blocks", "interleaved",
           "layerkv", "none", "offload_time_s", "retained_layers"]
