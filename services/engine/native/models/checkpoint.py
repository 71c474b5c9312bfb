"""load_checkpoint: a local Hugging Face checkpoint directory -> (CausalLM, tokenizer), never downloading."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from .config import ModelConfig
from .llama import CausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_checkpoint(path: str | Path, device: torch.device | str = "cpu",
                    dtype: torch.dtype | None = None) -> tuple[CausalLM, PreTrainedTokenizerBase]:
    """Read config.json, every safetensors shard and the tokenizer of the directory `path`.

    `dtype` None keeps the checkpoint's own dtype (config.json "dtype" / "torch_dtype"; float32 if
    absent). Raises FileNotFoundError for a missing directory, config, shard or tokenizer, and
    ValueError for an unsupported architecture or weights that do not fit the config.
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"checkpoint directory {root} does not exist")
    if not (root / "config.json").is_file():
        raise FileNotFoundError(f"{root} has no config.json: not a Hugging Face checkpoint directory")
    hf = json.loads((root / "config.json").read_text())
    config = ModelConfig.from_hf(hf)
    files = _weight_files(root)
    if not any((root / name).is_file() for name in TOKENIZER_FILES):
        raise FileNotFoundError(f"{root} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})")

    model = CausalLM(config, device=device, dtype=dtype or _checkpoint_dtype(hf))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(file))
    model.load_hf_state_dict(tensors)
    return model, AutoTokenizer.from_pretrained(str(root), local_files_only=True)


def _weight_files(root: Path) -> list[Path]:
    """The shards model.safetensors.index.json names, else every *.safetensors file."""
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = [root / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {missing}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        hint = " (.bin weights are not supported: convert them to safetensors)" if any(root.glob("*.bin")) else ""
        raise FileNotFoundError(f"{root} has no *.safetensors weights{hint}")
    return files


def _checkpoint_dtype(hf: dict[str, Any]) -> torch.dtype:
    dtype = getattr(torch, str(hf.get("dtype") or hf.get("torch_dtype") or "float32"), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32
