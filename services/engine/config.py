"""The engine's configuration, in a module of its own: the launcher and the manifests' generator read
it without importing torch and the model code (6 s)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from kvmesh.libs.controlplane import ServiceConfig
from kvmesh.policies.offload.plan import LayerDecode

from .model_source import DEFAULT_MODEL


class EngineConfig(ServiceConfig, kw_only=True):
    port: int = 8200
    # native: kvmesh's own torch engine, every paper mechanism; vllm: stock vLLM behind the same API,
    # with kvmesh's KV connector (docs/vllm.md; needs a Python with vLLM)
    backend: Literal["native", "vllm"] = "native"
    engine_id: str = "engine-0"
    role: str = "both"                 # prefill | decode | both
    # a preset (tiny, small), a packaged model (SmolLM2-135M-Instruct), a checkpoint directory or a
    # .gguf file (model_source.py); also the name clients ask for
    model: str = DEFAULT_MODEL
    seed: int = 0                      # for the random weights of a preset
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: bfloat16 where it is native (dtypes.py)
    device: str = "cpu"                # cpu | cuda | cuda:N
    # A model from a GGUF file: multiply its Q4_1 / Q8_0 blocks as they ship in steps of up to
    # quantized_max_tokens tokens (decode; models/gguf_weights.py). auto: on a CPU with the C++ kernels.
    quantized_weights: Literal["auto", "on", "off"] = "auto"
    # 0: what factory.quantized_max_tokens measured per kind of block: 32 where bf16 steps take the
    # AMX tiles or (Q4_1) bf16 dot products, else 4 (float32 sums; crossover ~6)
    quantized_max_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    block_size: int = 16
    device_blocks: int = 0             # capacity of the device tier in blocks; 0: from device_bytes
    device_bytes: int = 512 * 2**20   # SmolLM2-135M in bf16: 23k tokens (its context is 8,192)
    cxl_blocks: int = 0                # capacity of the cxl tier in blocks; 0: from cxl_bytes
    cxl_bytes: int = 128 * 2**20
    cxl_path: str | None = None        # back the cxl tier with a file or DAX device instead of RAM
    max_num_seqs: int = 64
    # tokens computed per step (chunked prefill); 0: factory.token_budget's choice for the role (2048 where
    # decodes share the steps, as vLLM's CPU server; 512 on a prefill-only engine)
    token_budget: Annotated[int, msgspec.Meta(ge=0)] = 0
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
    layer_staging_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0  # the most a step may lend; 0: half the tier
    layer_free_threshold: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.1  # Eq. 5: offload retained layers when
                                                                  # free device blocks are forecast below this share
    layer_forecast_stages: Annotated[int, msgspec.Meta(ge=1)] = 8  # how far ahead Eq. 5 looks, in stages of
                                                                  # block_size decode steps
    layer_decode: LayerDecode = "restore"  # a decode's offloaded layers: restored once, or staged every step
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


Config = EngineConfig
