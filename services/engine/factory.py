"""Builds an engine from its configuration: the model, the tier pools, the block manager, the
scheduler and the runner."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvmesh.libs.controlplane import ServiceConfig

from .block_manager import BlockManager
from .engine import Engine
from .kv_pool import BlockShape, KVPool
from .model_runner import ModelRunner
from .models import PRESETS, build_preset, load_checkpoint
from .policy_set import Policies
from .scheduler import Scheduler


class EngineConfig(ServiceConfig, kw_only=True):
    port: int = 8200
    engine_id: str = "engine-0"
    role: str = "both"                 # prefill | decode | both
    model: str = "tiny"                # a preset name, or a Hugging Face checkpoint directory
    seed: int = 0                      # for the random weights of a preset
    dtype: str = "float32"             # float32 | bfloat16
    device: str = "cpu"                # cpu | cuda | cuda:N
    block_size: int = 16
    device_blocks: int = 0             # capacity of the device tier in blocks; 0: from device_bytes
    device_bytes: int = 64 * 2**20
    cxl_blocks: int = 0                # capacity of the cxl tier in blocks; 0: from cxl_bytes
    cxl_bytes: int = 128 * 2**20
    cxl_path: str | None = None        # back the cxl tier with a file or DAX device instead of RAM
    max_num_seqs: int = 64
    token_budget: int = 512            # tokens computed per step (chunked prefill)
    max_model_len: int = 0             # 0: the model's limit, or what the device tier holds if less
    prefix_caching: bool = True
    policies: dict[str, str] = {}
    torch_threads: int = 0             # 0: torch's default
    dataplane: str = "tcp"             # KV hand-off between engines: tcp | shm | verbs | none
    data_host: str = "127.0.0.1"       # where this engine's data-plane endpoint listens
    data_port: int = 0                 # 0: any free port
    kv_lease_ms: int = 30_000          # prefill role: how long held KV waits for its decode engine
    kv_timeout_ms: int = 5_000         # a pull (or its COMPLETE) with no progress this long fails
    kvmeta_url: str | None = None      # register with kvmeta and heartbeat when set
    advertise_url: str | None = None   # the control URL others reach this engine at
    heartbeat_ttl_ms: int = 3_000


def build_engine(config: EngineConfig) -> Engine:
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]
    if config.model in PRESETS:
        model, tokenizer = build_preset(config.model, device=config.device, dtype=dtype, seed=config.seed)
    else:
        model, tokenizer = load_checkpoint(Path(config.model), device=config.device, dtype=dtype)
    model.eval()
    spec = model.config
    shape = BlockShape(config.block_size, spec.num_kv_heads, spec.head_dim, dtype)
    # The shm data plane maps a peer's pool from a file, so the device pool lives in one then.
    shared = config.dataplane == "shm"
    pools = {"device": KVPool("device", config.device_blocks or shape.blocks_in(config.device_bytes), shape,
                              config.device, device_pool_path(config) if shared else None)}
    cxl_blocks = config.cxl_blocks or shape.blocks_in(config.cxl_bytes)
    if cxl_blocks:
        pools["cxl"] = KVPool("cxl", cxl_blocks, shape, "cpu", config.cxl_path)
    policies = Policies(config.policies)
    blocks = BlockManager(pools, spec.num_layers, policies, model=config.model,
                          prefix_caching=config.prefix_caching)
    scheduler = Scheduler(blocks, policies, config.max_num_seqs, config.token_budget)
    runner = ModelRunner(model, pools["device"], spec.num_layers, spec.head_dim)
    return Engine(runner, blocks, scheduler, tokenizer, tuple(spec.eos_token_ids), engine_id=config.engine_id,
                  kv_lease_s=config.kv_lease_ms / 1e3)


def device_pool_path(config: EngineConfig) -> Path:
    """The file behind the device pool when the shm data plane maps it (removed at shutdown)."""
    return Path("/dev/shm") / f"kvmesh-{config.engine_id}-{os.getpid()}-device"


def max_model_len(config: EngineConfig, engine: Engine) -> int:
    """The longest prompt + output one request may have: the model's limit, and what fits in the
    device tier with every other request gone."""
    capacity = engine.blocks.device.num_blocks // engine.blocks.num_layers * engine.blocks.block_size
    spec = engine.runner.model.config
    limit = min(spec.max_position_embeddings, capacity, spec.sliding_window or capacity)  # no sliding window yet
    return min(limit, config.max_model_len) if config.max_model_len else limit
