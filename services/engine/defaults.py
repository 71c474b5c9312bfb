"""An engine's configuration with its `auto` settings decided for this machine, role and backend, and
the settings both backends hand to the policies."""

from __future__ import annotations

import msgspec
import torch

from kvmesh.policies.allocation import AllocationParams

from .config import EngineConfig
from .dtypes import fastest_dtype


def decided(config: EngineConfig) -> EngineConfig:
    """The configuration with its `auto` settings decided for this machine and role: the dtype and the
    token budget. On the vLLM backend on a CPU the dtype is float32: vLLM 0.32's CPU build answers
    SmolLM2-135M-Instruct with wrong text in bfloat16 ("What is the capital of France?" -> "L'Étoile,
    la Marseillaise, ..."; float32 and transformers and the native engine in bfloat16 say Paris;
    docs/vllm.md)."""
    if config.dtype == "auto":
        cpu_vllm = config.backend == "vllm" and torch.device(config.device).type == "cpu"
        config = msgspec.structs.replace(config, dtype="float32" if cpu_vllm else fastest_dtype(config.device))
    if not config.token_budget:
        config = msgspec.structs.replace(config, token_budget=token_budget(config.role))
    return config


def token_budget(role: str) -> int:
    """Tokens a step computes, by default. Where decodes share the steps, 2048, vLLM's CPU server's
    max_num_batched_tokens: a step carries all its decodes and up to eight new 256-token prompts, so
    the decodes' share of a step (their attention, the LM head, sampling) is paid once for more
    prompts. On SmolLM2 under 6 req/s of 256-token prompts (in-process, 2 threads, two runs each) the
    P90 TTFT was 1.2-1.9 s against 3.1-3.8 s with 512. A prefill-only engine has no decodes to
    amortise: 512 lets the first prompts of a burst leave (and their KV start moving) sooner."""
    return 512 if role == "prefill" else 2048


def allocation_params(config: EngineConfig) -> AllocationParams:
    return AllocationParams(block_tokens=config.kv_block_tokens, embed_buffer=config.kv_embed_buffer,
                            proactive_iterations=config.kv_proactive_iterations,
                            reserved_blocks=config.kv_reserved_blocks, epsilon_s=config.kv_critical_epsilon_ms / 1e3,
                            no_slo_rt_s=config.kv_no_slo_rt_s)
