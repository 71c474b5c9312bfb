"""The model: tensors in, hidden states and logits out; knows nothing of pools (docs/engine.md)."""

from .checkpoint import load_checkpoint
from .config import ModelConfig
from .llama import CausalLM
from .presets import PRESETS, build_preset, save_preset_checkpoint

__all__ = ["CausalLM", "ModelConfig", "PRESETS", "build_preset", "load_checkpoint", "save_preset_checkpoint"]
