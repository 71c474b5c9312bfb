"""Builds an engine from its configuration: the model, the tier pools, the block manager, the
scheduler and the runner."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import torch

from kvmesh.libs.controlplane import ConfigError, ServiceConfig
from kvmesh.policies import registry
from kvmesh.policies.allocation import AllocationParams
from kvmesh.policies.offload.plan import OffloadParams

from .block_manager import BlockManager
from .engine import Engine
from .kv_pool import BlockShape, KVPool
from .layer_staging import ChunkedCopier, LayerStaging, SideCopies
from .reuse import Reuse, WindowParams
from .model_runner import ModelRunner
from .models import PRESETS, build_preset, load_checkpoint
from .policy_set import Policies
from .scheduler import Scheduler
from .layer_profile import profile_layerkv
from .sparsity_profile import profile_sparsity
from .token_scores import ScoreProbe
from .swap_profile import profile_lengths, profile_swap

log = logging.getLogger(__name__)

SWAP_BLIND_STRATEGIES = ("recompute", "swap")  # built-in preemption strategies that never read swap curves


class EngineConfig(ServiceConfig, kw_only=True):
    port: int = 8200
    # native: kvmesh's own torch engine, every paper mechanism; vllm: stock vLLM behind the same API,
    # with kvmesh's KV connector (docs/vllm.md; needs a Python with vLLM)
    backend: Literal["native", "vllm"] = "native"
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
    # CaR (docs/car.md): prefix-cache nodes the device evicts move to the cxl tier and come back on a hit.
    prefix_cache_cxl: bool = False
    cache_high_water: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.9  # idle nodes move out past this share in use
    car_window: Annotated[int, msgspec.Meta(ge=1)] = 8            # requests in the Shuffled Window (`car` admission)
    car_max_wait_ms: Annotated[float, msgspec.Meta(gt=0)] = 2000.0  # queued this long: into the window first
    # CaR III-D: a node moving to the cxl tier keeps only each layer's best-attended tokens (docs/car.md).
    prefix_cache_sparsify: bool = False
    sparsify_keep_ratios: list[Annotated[float, msgspec.Meta(gt=0, le=1)]] = []  # per layer; empty: profiled
    sparsify_keep_floor: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.25  # profiled ratios keep at least this
    sparsify_quality_bound: Annotated[float, msgspec.Meta(ge=0)] = 0.05  # nats: mean |change| of held-out
                                                                  # next-token log-likelihoods allowed
    policies: dict[str, str] = {}
    # CacheOpt 3.3's allocation ledger (read by every kv_allocation policy but block_at_a_time).
    kv_block_tokens: Annotated[int, msgspec.Meta(ge=1)] = 8       # B: basic extra KV, and one on-demand step
    kv_embed_buffer: Annotated[int, msgspec.Meta(ge=0)] = 8       # b: buffer between an embedded guest and its host
    kv_proactive_iterations: Annotated[int, msgspec.Meta(ge=0)] = 2  # m
    kv_reserved_blocks: Annotated[int, msgspec.Meta(ge=0)] = 8    # the global reservation, blocks per layer
    kv_critical_epsilon_ms: Annotated[float, msgspec.Meta(ge=0)] = 5.0  # epsilon
    kv_no_slo_rt_s: Annotated[float, msgspec.Meta(gt=0)] = 10.0   # RT of a request without an SLO
    # CacheOpt 3.5: time recompute and swap at start (with a cxl tier) and fit the curves `sweet_spot` reads.
    # auto: when the configured preemption strategy may read them (any but `recompute` and `swap`).
    swap_profile: Literal["auto", "on", "off"] = "auto"
    swap_profile_lengths: list[int] = []  # tokens; empty: 5 spaced geometrically from one block to the context
    swap_profile_repeats: Annotated[int, msgspec.Meta(ge=1)] = 3  # timings at each length; the median counts
    # LayerKV: offloaded layers are computed in a staging area each step lends from the free device blocks.
    layer_staging_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0  # the most a step may lend; 0: the device tier
    layer_free_threshold: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.1  # Eq. 5: offload retained layers when
                                                                  # free device blocks are forecast below this share
    layer_forecast_stages: Annotated[int, msgspec.Meta(ge=1)] = 8  # how far ahead Eq. 5 looks, in stages of
                                                                  # block_size decode steps
    layer_copy_chunk_blocks: Annotated[int, msgspec.Meta(ge=1)] = 64  # blocks per copy between link checks (3.1.3)
    layer_copy_thread: bool = False    # CPU: copy layers on a worker thread, not inline (cores to spare; a GPU
                                       # always copies on a side stream)
    # Fit Eq. 3 and Eq. 4 at start; auto: when a LayerKV policy (admission or offload) is configured.
    layer_profile: Literal["auto", "on", "off"] = "auto"
    output_len_fallback: Annotated[int, msgspec.Meta(ge=0)] = 0   # output length LayerKV assumes without a
                                                                  # prediction; 0: none (1 token still to come)
    torch_threads: int = 0             # 0: torch's default
    dataplane: str = "tcp"             # KV hand-off between engines: tcp | shm | verbs | none
    data_host: str = "127.0.0.1"       # where this engine's data-plane endpoint listens
    data_interface: str | None = None  # listen on this interface's IPv4 address instead (a secondary network's)
    # verbs: an RDMA device name, or auto: the one on data_interface's PCI function, else the nearest the
    # GPU on the PCIe tree, else the first (libs/rdma/topology.py)
    rdma_device: str = "auto"
    rdma_port: Annotated[int, msgspec.Meta(ge=1)] = 1
    rdma_gid_index: Annotated[int, msgspec.Meta(ge=0)] | None = None  # None: the RoCE v2 GID of an IPv4 address
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
    # The shm data plane maps a peer's pools from files, so the pools live in them then.
    shared = shm_pool_paths(config)
    device_blocks = config.device_blocks or shape.blocks_in(config.device_bytes)
    cxl_blocks = config.cxl_blocks or shape.blocks_in(config.cxl_bytes)
    staging = staging_blocks(config, device_blocks, cxl_blocks)
    layerkv = bool(config.layer_staging_blocks) or uses_layerkv(config, "layer_offload")
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
                              horizon_stages=config.layer_forecast_stages),
                          reuse=Reuse(blocks, WindowParams(config.car_window, config.car_max_wait_ms / 1e3)))
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


def uses_layerkv(config: EngineConfig, hook: str) -> bool:
    return config.policies.get(hook, registry.DEFAULTS[hook]) not in ("none", "fcfs")


def staging_blocks(config: EngineConfig, device_blocks: int, cxl_blocks: int) -> int:
    """The most device blocks a step may lend for LayerKV's staging area: as configured, else the
    whole device tier (its free blocks bound it then); none without a cxl tier. A half of the area
    holds one layer of every request the step stages, so with every layer offloaded a tier of free
    blocks runs L/2 times the requests it holds with every layer on it."""
    if not cxl_blocks:
        if config.layer_staging_blocks or uses_layerkv(config, "layer_offload"):
            raise ConfigError("layer-wise offloading (layer_offload, layer_staging_blocks) needs a cxl tier to "
                              "offload to: set cxl_blocks or cxl_bytes")
        return 0
    if config.layer_staging_blocks > device_blocks or config.layer_staging_blocks == 1:
        raise ConfigError(f"layer_staging_blocks ({config.layer_staging_blocks}) is lent from the device tier's "
                          f"{device_blocks} blocks in two halves: at least 2 and at most the tier")
    return config.layer_staging_blocks or device_blocks


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


def allocation_params(config: EngineConfig) -> AllocationParams:
    return AllocationParams(block_tokens=config.kv_block_tokens, embed_buffer=config.kv_embed_buffer,
                            proactive_iterations=config.kv_proactive_iterations,
                            reserved_blocks=config.kv_reserved_blocks, epsilon_s=config.kv_critical_epsilon_ms / 1e3,
                            no_slo_rt_s=config.kv_no_slo_rt_s)


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
    return {tier: Path("/dev/shm") / f"kvmesh-{config.engine_id}-{os.getpid()}-{tier}" for tier in tiers}


def max_model_len(config: EngineConfig, engine: Engine) -> int:
    """The longest prompt + output one request may have: the model's limit, and what fits in the
    device tier with every other request gone."""
    capacity = engine.blocks.device.num_blocks // engine.blocks.num_layers * engine.blocks.block_size
    spec = engine.runner.model.config
    limit = min(spec.max_position_embeddings, capacity, spec.sliding_window or capacity)  # no sliding window yet
    return min(limit, config.max_model_len) if config.max_model_len else limit
