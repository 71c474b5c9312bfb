"""Stock vLLM as the engine service's backend (`backend = "vllm"`, docs/vllm.md; backend.py): the same
HTTP API, registration and heartbeats as the native engine's, so that admission and the scheduler
cannot tell the backends apart. Prefill engines run vLLM with KVMeshConnector as producer, decode engines as
consumer; the connector's kv_transfer_params travel as kvmesh's KVHandle.

With `prefix_cache_cxl` the connector also keeps prefix blocks in a cxl tier of `cxl_blocks` (or
`cxl_bytes`) in host memory, on any role (a colocated engine runs it as kv_both without a data plane).
What only the native engine has is refused with a 400 or a config error that says so: push mode,
engine policies other than KVMeshScheduler's, LayerKV's offload, CaR's sparsification.
Run it with a Python that has vLLM: `.venv-vllm/bin/python -m kvmesh serve engine` on CPU here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import shutil
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import torch

from kvmesh.libs.controlplane import BadRequest
from kvmesh.libs.controlplane.ports import free_port
from kvmesh.libs.kvmeta.messages import BlockGeometry, Capacity, GpuNic
from kvmesh.libs.messages.engine import Frame, GenerateRequest, SamplingParams

from ..backend import EngineBackend, tokenizer_spec
from ..cache_publisher import CacheJournal
from ..config import EngineConfig
from ..data_link import data_link
from ..defaults import allocation_params
from ..metrics import EngineCollector
from ..state import EngineState
from .engine_thread import VllmThread
from .outputs import Counters, Tracked, abort_request, frame_of, observe, scheduler_of, tier_journal, worker_connector
from .policy_hooks import TARGETS
from .prefill_profile import profile_prefill_cost
from .settings import (CONNECTOR, KV_ROLES, SCHEDULER, checkpoint, cxl_tier_blocks, geometry_of, kv_context_limit,
                       refuse_native_only, vllm_environment)


class VllmBackend(EngineBackend):
    name = "vllm"
    collector = EngineCollector

    def __init__(self, config: EngineConfig):
        refuse_native_only(config)
        from transformers import AutoConfig, AutoTokenizer

        self.config = config
        self.model_dir, self.scratch = checkpoint(config)
        self.link = data_link(config) if config.role in ("prefill", "decode") and config.dataplane != "none" else None
        self.data_port = config.data_port or (free_port(self.link.host) if self.link and config.role == "prefill" else 0)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        hf_config = AutoConfig.from_pretrained(self.model_dir)
        self.model = geometry_of(hf_config)
        self.vocab_size = self.model.vocab_size
        self.max_model_len = kv_context_limit(config, self.model, hf_config.max_position_embeddings)
        self.cxl_blocks = cxl_tier_blocks(config, self.model)
        self.counters = Counters()
        self.data_address = f"{self.link.host}:{self.data_port}" if self.link and config.role == "prefill" else ""
        self.pairing = [GpuNic(gpu=self.link.gpu, nic=self.link.nic, address=self.data_address)] \
            if self.data_address else []

    def start(self, on_frames: Callable[[list[Frame]], None]) -> None:
        def on_outputs(outputs: list) -> None:  # on the engine's thread
            on_frames([frame_of(output, self.counters, self.config, self.model, self.block_size, self.engine.engine)
                       for output in outputs])

        self.engine = VllmThread(self._build, on_outputs, observe=lambda e: observe(e, self.counters))
        self.engine.start()
        self.on_frames = on_frames
        self.block_size = self.engine.engine.vllm_config.cache_config.block_size
        self.context_limit = self.engine.engine.model_config.max_model_len
        self.tokenizer_spec = tokenizer_spec(self.config.model, self.tokenizer, self._eos_token_ids(),
                                             self.context_limit)
        self.geometry = BlockGeometry(block_size=self.block_size, num_layers=self.model.num_layers,
                                      num_kv_heads=self.model.num_kv_heads, head_dim=self.model.head_dim,
                                      dtype=self.config.dtype)
        self.capacity = Capacity(device_blocks=self.counters.state.total_blocks["device"])

    def _build(self):
        """vLLM's engine, in this process (the service steps it), with KVMeshScheduler and, for a
        hand-off or a cxl tier, KVMeshConnector."""
        config, link = self.config, self.link
        vllm_environment(config)
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        transfer = None
        if link is not None or self.cxl_blocks:
            settings = {"handoff": link is not None, "cxl_blocks": self.cxl_blocks, "model": config.model}
            if link is not None:
                settings.update(backend=config.dataplane, token=config.token, data_host=link.host,
                                data_port=self.data_port, lease_s=config.kv_lease_ms / 1e3,
                                timeout_s=config.kv_timeout_ms / 1e3, endpoint=link.options)
            transfer = KVTransferConfig(**CONNECTOR, engine_id=config.engine_id, kv_load_failure_policy="recompute",
                                        kv_role=KV_ROLES[config.role], kv_connector_extra_config=settings)
        args = EngineArgs(model=str(self.model_dir), dtype=config.dtype, seed=config.seed, block_size=config.block_size,
                          max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
                          max_num_batched_tokens=max(config.token_budget, config.max_model_len),
                          enable_prefix_caching=config.prefix_caching, enforce_eager=True,
                          kv_cache_memory_bytes=config.device_bytes, disable_log_stats=True,
                          kv_transfer_config=transfer, scheduler_cls=SCHEDULER,
                          additional_config={"kvmesh": {"policies": dict(config.policies),
                                                       "allocation": dataclasses.asdict(allocation_params(config))}})
        built = LLMEngine.from_engine_args(args)
        if config.layer_profile == "on" or (config.layer_profile == "auto"
                                            and config.policies.get("prefill_admission") == "layerkv"):
            scheduler_of(built).prefill_cost = profile_prefill_cost(
                built, self.model_dir, self.model.hidden_size, self.vocab_size, getattr(torch, config.dtype),
                min(built.model_config.max_model_len // 2, 512), repeats=2)
        return built

    def _eos_token_ids(self) -> list[int]:
        from transformers import GenerationConfig

        eos = {self.tokenizer.eos_token_id} if self.tokenizer.eos_token_id is not None else set()
        with contextlib.suppress(OSError):
            configured = GenerationConfig.from_pretrained(self.model_dir).eos_token_id
            eos |= set(configured if isinstance(configured, list) else [configured] if configured is not None else [])
        return sorted(eos)

    async def __aexit__(self, *exc: object) -> None:
        try:
            await asyncio.to_thread(self.engine.stop)
        finally:
            if self.scratch is not None:
                shutil.rmtree(self.scratch, True)

    def state(self) -> EngineState:
        return self.counters.state

    async def add(self, request_id: str, body: GenerateRequest, ids: list[int], sampling: SamplingParams,
                  arrival: float) -> None:
        params = transfer_params(self.config, body, ids, self.model.num_layers, self.block_size)
        extra = msgspec.to_builtins(body.targets)  # the ones it has: None is the default, omitted
        tracked = self.counters.tracked

        def add(e) -> None:
            tracked[request_id] = request = Tracked(len(ids), arrival, body.kv_transfer is not None,
                                                    logprobs=sampling.logprobs)
            request.vllm_id = e.add_request(request_id, {"prompt_token_ids": ids},
                                            vllm_sampling(sampling, params, extra), arrival_time=arrival)
        try:
            await asyncio.wrap_future(self.engine.call(add))
        except Exception as exc:  # vLLM's own checks (say, a prompt its scheduler can never fit)
            tracked.pop(request_id, None)
            raise BadRequest(f"vLLM refused the request: {exc}") from None

    def abort_soon(self, request_id: str) -> None:
        self.engine.call(lambda e: abort_request(e, request_id, self.counters.tracked))

    async def abort(self, request_id: str) -> bool:
        frames = await asyncio.wrap_future(self.engine.call(lambda e: abort_request(e, request_id,
                                                                                    self.counters.tracked)))
        self.on_frames(frames)
        return bool(frames)

    async def abort_all(self, request_ids: list[str]) -> None:
        tracked = self.counters.tracked
        self.on_frames(await asyncio.wrap_future(self.engine.call(
            lambda e: [frame for r in request_ids for frame in abort_request(e, r, tracked)])))

    async def set_policies(self, policies: dict[str, str]) -> dict[str, str]:
        """KVMeshScheduler's policies (policy_hooks.HOOKS)."""
        def switch(e) -> dict[str, str]:
            scheduler = scheduler_of(e)
            scheduler.set_policies(policies)
            return dict(scheduler.policy_names)
        return await asyncio.wrap_future(self.engine.call(switch))

    def cache_journal(self) -> tuple[CacheJournal, Callable[[Callable[[], Any]], Awaitable[Any]]] | None:
        """The cxl tier's nodes, for the scheduler's prefix-aware routing."""
        table = scheduler_of(self.engine.engine).connector.table if self.cxl_blocks else None
        if table is None:
            return None
        on_engine = lambda read: asyncio.wrap_future(self.engine.call(lambda e: read()))  # noqa: E731
        return tier_journal(table, worker_connector().tier.slot_bytes), on_engine


def transfer_params(config: EngineConfig, body: GenerateRequest, ids: list[int], num_layers: int,
                     block_size: int) -> dict | None:
    """The connector's kv_transfer_params for a hand-off, or a 400 when this engine cannot do it."""
    if body.kv_transfer is not None:
        if config.role != "prefill" or config.dataplane == "none":
            raise BadRequest(f"kv_transfer: this engine ({config.role}, data plane {config.dataplane}) does not "
                             "hand off KV")
        if body.kv_transfer.mode != "pull":
            raise BadRequest("kv_transfer: the vLLM backend hands KV off in pull mode only")
        return {"do_remote_decode": True}
    if body.kv_source is not None:
        if config.role != "decode" or config.dataplane == "none":
            raise BadRequest(f"kv_source: this engine ({config.role}, data plane {config.dataplane}) does not pull KV")
        handle = body.kv_source
        handle.check(num_layers, block_size, len(ids) - 1)
        if handle.tiers is not None and set(handle.tiers) != {"device"}:
            raise BadRequest("kv_source: the vLLM backend pulls from a prefill engine's device tier only")
        return {"remote_engine_id": handle.engine, "remote_request_id": handle.request_id,
                "remote_address": handle.data_address, "remote_block_ids": list(handle.layers[0]),
                "num_tokens": handle.num_tokens}
    return None


def vllm_sampling(sampling: SamplingParams, kv_transfer_params: dict | None, targets: dict):
    """vLLM's sampling parameters; the hand-off's kv_transfer_params and the request's SLOs and predicted
    lengths (for KVMeshScheduler) ride in extra_args."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VllmSamplingParams(max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
                              top_p=sampling.top_p, seed=sampling.seed, stop=list(sampling.stop),
                              stop_token_ids=list(sampling.stop_token_ids), ignore_eos=sampling.ignore_eos,
                              logprobs=0 if sampling.logprobs else None, output_kind=RequestOutputKind.DELTA,
                              extra_args={**({"kv_transfer_params": kv_transfer_params} if kv_transfer_params
                                                 else {}), TARGETS: targets})
