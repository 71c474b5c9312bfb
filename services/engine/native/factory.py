"""Builds an engine from its configuration: the model, the tier pools, the block manager, the
scheduler and the runner."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from kvmesh.libs.controlplane import ConfigError
from kvmesh.libs.rdma.shm.shared import owned_path
from kvmesh.policies import registry
from kvmesh.policies.iteration import Policies
from kvmesh.policies.iteration.reuse import Reuse, WindowParams
from kvmesh.policies.offload.plan import OffloadParams

from ..config import EngineConfig
from ..defaults import allocation_params, decided
from ..kv_blocks import BlockShape
from ..model_source import resolve_model
from .attention import backend
from .block_manager import BlockManager
from .engine import Engine
from .kv_pool import KVPool
from .layer_profile import profile_layerkv
from .layer_staging import ChunkedCopier, LayerStaging, SideCopies
from .link_bandwidth import link_bandwidth
from .model_runner import ModelRunner
from .models import build_preset, load_checkpoint
from .models.gguf_weights import load_gguf_weights
from .quant import BLOCK_BYTES, bf16_dots, tile_path
from .scheduler import Scheduler
from .sparsity_profile import profile_sparsity
from .swap_profile import profile_lengths, profile_swap
from .token_scores import ScoreProbe

log = logging.getLogger(__name__)

SWAP_BLIND_STRATEGIES = ("recompute", "swap")  # built-in preemption strategies that never read swap curves


def build_engine(config: EngineConfig) -> Engine:
    config = decided(config)
    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]
    source = resolve_model(config.model)
    if source.preset is not None:
        model, tokenizer = build_preset(source.preset, device=config.device, dtype=dtype, seed=config.seed)
    else:
        model, tokenizer = load_checkpoint(source.checkpoint, device=config.device, dtype=dtype)
        if source.gguf is not None and wants_quantized(config):
            weights = load_gguf_weights(source.gguf, model.config, config.device)
            if weights is None and config.quantized_weights == "on":
                raise ConfigError(f"quantized_weights on: {source.gguf.name} has weights the kernels do not read")
            if weights is not None:
                model.use_quantized(weights, quantized_max_tokens(config, dtype))
    model.eval()
    spec = model.config
    shape = BlockShape(config.block_size, spec.num_kv_heads, spec.head_dim, dtype)
    # The shm data plane maps a peer's pools from files, so the pools live in them then.
    shared = shm_pool_paths(config)
    device_blocks = config.device_blocks or shape.blocks_in(config.device_bytes)
    cxl_blocks = config.cxl_blocks or shape.blocks_in(config.cxl_bytes)
    layerkv = bool(config.layer_staging_blocks) or uses_layerkv(config, "layer_offload")
    staging = staging_blocks(config, layerkv, device_blocks, cxl_blocks)
    if config.prefix_cache_cxl and not (cxl_blocks and config.prefix_caching):
        raise ConfigError("prefix_cache_cxl keeps prefix-cache nodes in the cxl tier: it needs prefix_caching and a "
                          "cxl tier (cxl_blocks or cxl_bytes)")
    if config.prefix_cache_sparsify and not config.prefix_cache_cxl:
        raise ConfigError("prefix_cache_sparsify drops tokens of nodes moving to the cxl tier: it needs prefix_cache_cxl")
    if config.prefix_cache_sparsify and config.role == "prefill":
        # A decode engine pulls whole blocks: the slots a sparsified node dropped would reach it unmasked.
        raise ConfigError("prefix_cache_sparsify is for engines that decode what they cache (role both or decode), "
                          "not role prefill")
    pools = {"device": KVPool("device", device_blocks, shape, config.device, shared.get("device"))}
    if cxl_blocks:
        pools["cxl"] = KVPool("cxl", cxl_blocks, shape, "cpu", config.cxl_path or shared.get("cxl"))
    policies = Policies(config.policies)
    blocks = BlockManager(pools, spec.num_layers, policies, model=config.model, prefix_caching=config.prefix_caching,
                          cache_cxl=config.prefix_cache_cxl, high_water=config.cache_high_water)
    scheduler = Scheduler(blocks, policies, config.max_num_seqs, config.token_budget, allocation_params(config),
                          staging_cap=staging // 2, offload=OffloadParams(
                              threshold_blocks=int(config.layer_free_threshold * pools["device"].num_blocks),
                              horizon_stages=config.layer_forecast_stages, decode_offloaded=config.layer_decode),
                          reuse=Reuse(blocks, WindowParams(config.car_window, config.car_max_wait_ms / 1e3),
                                      link_bandwidth(blocks) if blocks.cache_cxl else 0.0))
    if layerkv:  # LayerKV 3.1.3: copies between the tiers in chunks, each after a check of the link
        blocks.copy = ChunkedCopier(chunk_blocks=config.layer_copy_chunk_blocks)
    layer_staging = None
    if staging:
        layer_staging = LayerStaging(pools["device"], pools["cxl"], blocks.copy, config.layer_copy_thread)
    reloads = None
    if blocks.cache_cxl:  # CaR: reloads at a request's turn copy layer by layer inside its step
        blocks.layerwise_reload = True
        reloads = SideCopies(pools["device"].tensor.device, blocks.copy, config.layer_copy_thread)
    probe = None
    if config.prefix_cache_sparsify:
        for tier, pool in pools.items():
            pool.track_tokens(scores=tier == "device")
        device = pools["device"]
        probe = ScoreProbe(device.tensor, device.valid, device.scores, spec.head_dim ** -0.5)
    runner = ModelRunner(model, pools["device"], spec.num_layers, spec.head_dim, layer_staging, reloads, probe)
    engine = Engine(runner, blocks, scheduler, tokenizer, tuple(spec.eos_token_ids), engine_id=config.engine_id,
                    kv_lease_s=config.kv_lease_ms / 1e3, output_len_fallback=config.output_len_fallback or None)
    if wants_swap_profile(config, blocks):
        _profile_swap(config, engine)
    if wants_layer_profile(config):
        _profile_layers(config, engine)
    if config.prefix_cache_sparsify:
        _profile_sparsity(config, engine)
    return engine


def _profile_sparsity(config: EngineConfig, engine: Engine) -> None:
    started = time.perf_counter()
    profile = profile_sparsity(engine.runner.model, engine.tokenizer, config.block_size, config.sparsify_keep_floor,
                               config.sparsify_quality_bound, config.sparsify_keep_ratios)
    engine.sparsity_profile = profile
    engine.blocks.keep_tokens = profile.keep_tokens
    log.info("CaR sparsity profile in %.2fs: %s", time.perf_counter() - started, profile)


def wants_quantized(config: EngineConfig) -> bool:
    """Whether to serve a GGUF model's quantised blocks: `on`, or `auto` on a CPU whose C++ kernels
    built (elsewhere the blocks would be dequantised at every call)."""
    if config.quantized_weights != "auto":
        return config.quantized_weights == "on"
    return torch.device(config.device).type == "cpu" and backend(config.device) == "cpp"


def quantized_max_tokens(config: EngineConfig, dtype: torch.dtype) -> dict[str, int]:
    """The most rows of x a step multiplies by each kind of quantised block rather than by the dense
    weights: the setting for every kind, or (0) the measured crossovers (docs/engine.md). In bf16, 32
    where the blocks take the AMX tiles or (Q4_1) bf16 dot products: they read a quarter of the bytes
    and compute at about the dense bf16 rate, level with it at 32 rows. Otherwise 4: the float32 path
    computes on vectors and loses to oneDNN's bf16 at about 6 rows."""
    if config.quantized_max_tokens:
        return {kind: config.quantized_max_tokens for kind in BLOCK_BYTES}
    tiles = dtype == torch.bfloat16 and tile_path(config.device)
    dots = dtype == torch.bfloat16 and bf16_dots(config.device)
    return {"q4_1": 32 if tiles or dots else 4, "q8_0": 32 if tiles else 4}


def uses_layerkv(config: EngineConfig, hook: str) -> bool:
    return config.policies.get(hook, registry.DEFAULTS[hook]) not in ("none", "fcfs")


def staging_blocks(config: EngineConfig, layerkv: bool, device_blocks: int, cxl_blocks: int) -> int:
    """The most device blocks a step may lend for LayerKV's staging area: as configured, else half
    the device tier; none without a cxl tier (an error if `layerkv`, LayerKV's offloading, is
    configured). A half of the area holds one layer of every request the step stages, so by default
    L/4 times the requests the tier holds with every layer on it. More buys concurrency with copies
    every step that TPOT pays for on a CPU (docs/benchmarks.md)."""
    if not cxl_blocks:
        if layerkv:
            raise ConfigError("layer-wise offloading (layer_offload, layer_staging_blocks) needs a cxl tier to "
                              "offload to: set cxl_blocks or cxl_bytes")
        return 0
    if config.layer_staging_blocks > device_blocks or config.layer_staging_blocks == 1:
        raise ConfigError(f"layer_staging_blocks ({config.layer_staging_blocks}) is lent from the device tier's "
                          f"{device_blocks} blocks in two halves: at least 2 and at most the tier")
    return config.layer_staging_blocks or device_blocks // 2


def wants_layer_profile(config: EngineConfig) -> bool:
    """Whether to fit LayerKV's Eq. 3 and Eq. 4 at start."""
    if config.layer_profile != "auto":
        return config.layer_profile == "on"
    return uses_layerkv(config, "layer_offload") or uses_layerkv(config, "prefill_admission")


def _profile_layers(config: EngineConfig, engine: Engine) -> None:
    started = time.perf_counter()
    longest = min(max_model_len(config, engine), config.token_budget * 4)
    profile = profile_layerkv(engine.runner, engine.blocks, config.token_budget,
                              profile_lengths(engine.blocks.block_size, longest), repeats=3)
    engine.layer_profile = profile
    engine.blocks.use_layer_costs(profile.prefill_cost, profile.offload_cost)
    log.info("LayerKV profile in %.2fs: %s", time.perf_counter() - started, profile)


def wants_swap_profile(config: EngineConfig, blocks: BlockManager) -> bool:
    """Whether to profile swap vs recompute at start: never without a cxl tier to swap to."""
    if "cxl" not in blocks.pools or config.swap_profile == "off":
        return False
    strategy = config.policies.get("preemption_strategy", registry.DEFAULTS["preemption_strategy"])
    return config.swap_profile == "on" or strategy not in SWAP_BLIND_STRATEGIES


def _profile_swap(config: EngineConfig, engine: Engine) -> None:
    blocks = engine.blocks
    cxl_tokens = blocks.pools["cxl"].num_blocks // blocks.num_layers * blocks.block_size
    longest = min(max_model_len(config, engine), cxl_tokens)
    lengths = config.swap_profile_lengths or profile_lengths(blocks.block_size, longest)
    if not all(1 <= length <= longest for length in lengths):
        raise ConfigError(f"swap_profile_lengths must lie in [1, {longest}] (the context, and what the cxl tier "
                          f"holds), got {lengths}")
    started = time.perf_counter()
    engine.swap_profile = profile_swap(engine.runner, blocks, config.token_budget, lengths,
                                       config.swap_profile_repeats)
    blocks.use_swap_curves(engine.swap_profile.curves)
    curves = engine.swap_profile.curves
    log.info("swap profile: %d lengths in %.2fs, sweet spot %s tokens", len(lengths), time.perf_counter() - started,
             curves.sweet_spot if curves else "not fitted")


def shm_pool_paths(config: EngineConfig) -> dict[str, Path]:
    """The files behind the pools when the shm data plane maps them (removed at shutdown): the
    device tier, and the cxl tier unless it is given a file of its own (cxl_path)."""
    if config.dataplane != "shm":
        return {}
    tiers = ("device",) if config.cxl_path else ("device", "cxl")
    return {tier: owned_path(config.engine_id, tier) for tier in tiers}


def max_model_len(config: EngineConfig, engine: Engine) -> int:
    """The longest prompt + output one request may have: the model's limit, and what fits in the
    device tier with every other request gone."""
    capacity = engine.blocks.device.num_blocks // engine.blocks.num_layers * engine.blocks.block_size
    spec = engine.runner.model.config
    limit = min(spec.max_position_embeddings, capacity, spec.sliding_window or capacity)  # no sliding window yet
    return min(limit, config.max_model_len) if config.max_model_len else limit
