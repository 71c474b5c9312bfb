"""The vLLM backend's settings from an engine's configuration: what it refuses (the native engine's
alone), the environment vLLM reads, the checkpoint it loads, and its KV cache's context and cxl tier
sized from the memory it is given."""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmesh.libs.controlplane import ConfigError

from ..config import EngineConfig
from ..kv_blocks import BlockShape
from ..model_source import resolve_model, write_preset_checkpoint
from .policy_hooks import HOOKS

CONNECTOR = dict(kv_connector="KVMeshConnector", kv_connector_module_path="kvmesh.services.engine.vllm_backend.connector")
SCHEDULER = "kvmesh.services.engine.vllm_backend.scheduler.KVMeshScheduler"
CPU_BLOCK_MULTIPLE = 32   # vLLM's CPU attention wants blocks of a multiple of 32 tokens
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}


def refuse_native_only(config: EngineConfig) -> None:
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"backend vllm: {sys.executable} has no vLLM; run the engine with a Python that has it "
                          "(.venv-vllm/bin/python here, from scripts/setup-vllm.sh; kvmesh[vllm] on GPUs)")
    check_config(config)


def check_config(config: EngineConfig) -> None:
    """A ConfigError for settings an engine on vLLM cannot honour (what only the native engine has)."""
    others = sorted(set(config.policies) - set(HOOKS))
    if others:
        raise ConfigError(f"backend vllm: policies {', '.join(others)} are the native engine's; vLLM's takes "
                          f"{', '.join(HOOKS)} (docs/vllm.md)")
    native = [name for name, on in (("prefix_cache_sparsify", config.prefix_cache_sparsify),
                                    ("layer_staging_blocks", bool(config.layer_staging_blocks)),
                                    ("cxl_path", bool(config.cxl_path))) if on]
    if native:
        raise ConfigError(f"backend vllm: {', '.join(native)} are the native engine's (docs/vllm.md)")
    if config.prefix_cache_cxl and not config.prefix_caching:
        raise ConfigError("prefix_cache_cxl keeps prefix blocks vLLM's device cache lets go in the cxl tier: it "
                          "needs prefix_caching")
    if config.device == "cpu" and config.block_size % CPU_BLOCK_MULTIPLE:
        raise ConfigError(f"backend vllm: vLLM on the CPU needs block_size a multiple of {CPU_BLOCK_MULTIPLE}, "
                          f"got {config.block_size}")


def vllm_environment(config: EngineConfig) -> None:
    """What vLLM reads from the environment, set before it is imported: its core in this process (the
    service steps it), no downloads, and the KV cache sized by device_bytes, not VLLM_CPU_KVCACHE_SPACE."""
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if config.torch_threads:
        os.environ.setdefault("OMP_NUM_THREADS", str(config.torch_threads))


def checkpoint(config: EngineConfig) -> tuple[Path, Path | None]:
    """The checkpoint directory vLLM loads, and a scratch directory to remove at exit: a preset's
    weights (random, from `seed`, the same on every engine) are written to one first."""
    source = resolve_model(config.model)
    if source.preset is None:
        return source.checkpoint, None
    scratch = Path(tempfile.mkdtemp(prefix=f"kvmesh-{config.model}-"))
    return write_preset_checkpoint(source.preset, scratch, config.seed), scratch


def kv_context_limit(config: EngineConfig, geometry: Geometry, model_limit: int) -> int:
    """The longest request vLLM is told to take: max_model_len if set, else the model's own limit cut to
    what the KV cache (device_bytes) holds, in whole blocks. vLLM refuses to start when one request of
    its max_model_len does not fit; the native engine cuts its context the same way (factory.py)."""
    if config.max_model_len:
        return config.max_model_len
    token_bytes = BlockShape(1, geometry.num_kv_heads, geometry.head_dim, getattr(torch, config.dtype)).bytes \
        * geometry.num_layers
    fits = (config.device_bytes // token_bytes // config.block_size - 1) * config.block_size  # vLLM keeps a null block
    if fits < config.block_size:
        raise ConfigError(f"device_bytes {config.device_bytes} holds no block of this model's KV "
                          f"({token_bytes * config.block_size} bytes)")
    return min(model_limit, fits)


def cxl_tier_blocks(config: EngineConfig, geometry: Geometry) -> int:
    """The cxl tier's slots under prefix_cache_cxl: cxl_blocks, else as many blocks of every layer
    as cxl_bytes holds; 0 without it."""
    if not config.prefix_cache_cxl:
        return 0
    block_bytes = BlockShape(config.block_size, geometry.num_kv_heads, geometry.head_dim,
                             getattr(torch, config.dtype)).bytes * geometry.num_layers
    blocks = config.cxl_blocks or config.cxl_bytes // block_bytes
    if blocks <= 0:
        raise ConfigError(f"prefix_cache_cxl: cxl_bytes {config.cxl_bytes} holds no block of every layer "
                          f"({block_bytes} bytes)")
    return blocks


@dataclass
class Geometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    hidden_size: int


def geometry_of(hf_config) -> Geometry:
    heads = hf_config.num_attention_heads
    return Geometry(num_layers=hf_config.num_hidden_layers,
                    num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
                    head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
                    vocab_size=hf_config.vocab_size, hidden_size=hf_config.hidden_size)
