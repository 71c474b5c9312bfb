"""KVMeshConnector: vLLM's KV connector (KVConnectorBase_V1) for kvmesh's pull-mode hand-off.

Load it with
    KVTransferConfig(kv_connector="KVMeshConnector",
                     kv_connector_module_path="kvmesh.services.engine.vllm_backend.connector",
                     kv_role="kv_producer" | "kv_consumer" | "kv_both",
                     kv_connector_extra_config={"data_port": 7600, ...})   # see Settings

Prefill instance (producer). A request sent with kv_transfer_params {"do_remote_decode": true} keeps
its blocks when it finishes (request_finished delays the free) and returns in its output the
kv_transfer_params a decode instance needs: remote_engine_id, remote_request_id, remote_address
(this instance's data plane), remote_block_ids and num_tokens. Its worker serves every layer's KV
cache tensor to whoever CONNECTs; a COMPLETE for a held request releases it, and so does its lease
running out; either way get_finished reports it and vLLM frees the blocks.

Decode instance (consumer). A request carrying those params reports its whole prompt as loaded from
outside (vLLM computes the last token again, whose logits it samples from). Once vLLM has given them
local blocks, the worker pulls the remote blocks into them with one-sided reads (coalesced per
layer) and a COMPLETE. A prompt of up to `sync_load_tokens` tokens is pulled inside the step that
first runs the request, before its first layer, so its first token comes out of that step; a
longer one is pulled while the steps of other requests go on, get_finished reports it when the pull
is done, and vLLM schedules it then (a step or two later). A failed pull reports its blocks as not
loaded, and vLLM recomputes them (kv_load_failure_policy="recompute").

The cxl tier (CaR, `cxl_blocks` > 0; on any role, and on a colocated engine with `handoff` off):
every full block a request computes is also written to a host-memory tier, layer by layer right
after each layer runs (`save_kv_layer`, on a copy thread); a later request whose prefix vLLM's own
device cache no longer holds but the tier does gets those blocks loaded back instead of computed,
each layer just before it runs (`wait_for_layer_load`). host_table.py decides what the tier keeps,
host_tier.py moves the bytes.

One worker per instance (tensor parallelism 1): the prefill data plane listens at the configured
port, which is how the scheduler side knows its address.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.request import RequestStatus

from kvmesh.libs.rdma.kvdirect.node import KVDirectNode, ThreadedNode
from kvmesh.libs.rdma.kvdirect.puller import BlockReads, TransferReport
from kvmesh.libs.rdma.work import RdmaError
from kvmesh.policies.cache.replacement import car
from kvmesh.policies.views import blocks_for

from ..state import TransferTotals
from .host_table import HostTable
from .host_tier import HostTier
from .tier_plan import TierPlan

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

RECENT_PULLS = 256
PULL_YIELD_S = 0.001


class Settings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """kv_connector_extra_config."""

    backend: str = "tcp"             # the libs/rdma backend: tcp | shm | verbs
    token: str = "kvmesh"            # the cluster token a data-plane connection must carry
    data_host: str = "127.0.0.1"     # where a prefill instance's data plane listens
    data_port: int = 0               # and at which port: required for a producer
    lease_s: float = 30.0            # a prefill instance frees held KV no decode instance took by then
    timeout_s: float = 10.0          # a pull (or its COMPLETE) with no progress this long fails
    endpoint: dict[str, Any] = {}    # the backend's own options (verbs: device, gid_index, ib_port)
    handoff: bool = True             # False: no data plane (a colocated engine with only the cxl tier)
    cxl_blocks: int = 0              # the cxl tier's slots (a block of every layer each); 0: no tier
    model: str = ""                  # seeds the NodeIDs of cached blocks: the model name routing uses
    # Consumer: prompts of up to this many tokens are pulled inside the step that first runs them
    # (which waits for the pull); longer ones while other steps go on. 0: always the latter.
    sync_load_tokens: Annotated[int, msgspec.Meta(ge=0)] = 1024


@dataclass
class Load:
    request_id: str          # ours
    remote_request_id: str   # the prefill instance's
    address: str
    remote_blocks: list[int]
    local_blocks: list[int]
    in_step: bool = False    # pulled inside the step that runs the request (else while others run)
    started: float = 0.0     # worker side: when its pull began (unix seconds)


@dataclass
class KVMeshConnectorMetadata(KVConnectorMetadata):
    loads: list[Load] = field(default_factory=list)   # consumer: pull these before this step runs
    held: list[str] = field(default_factory=list)     # producer: finished requests whose KV now waits
    # cxl tier: (slots, blocks) to load before each layer runs, (blocks, slots) to save after it does
    tier_loads: tuple[list[int], list[int]] = ([], [])
    tier_saves: tuple[list[int], list[int]] = ([], [])


class KVMeshConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = msgspec.convert(self._kv_transfer_config.kv_connector_extra_config, Settings)
        if self.settings.handoff and self._kv_transfer_config.is_kv_producer and not self.settings.data_port:
            raise ValueError("KVMeshConnector: a producer needs kv_connector_extra_config data_port (its data plane)")
        self.block_size = vllm_config.cache_config.block_size
        self.engine_id = self._kv_transfer_config.engine_id
        # Scheduler side: what the next step's metadata carries.
        self._loads: list[Load] = []
        self._held: list[str] = []
        self._local_tokens: dict[str, int] = {}   # tokens a request found in our own prefix cache
        self.table = HostTable(self.settings.cxl_blocks, car) if self.settings.cxl_blocks else None
        self.tier_plan = TierPlan(self.table, self.block_size, self.settings.model) if self.table else None
        # Worker side.
        self.kv_caches: dict[str, torch.Tensor] = {}   # vLLM's, by layer name
        self.data_plane: ThreadedNode | None = None   # serves our layers (producer), pulls into them (consumer)
        self.tier: HostTier | None = None
        self._tier_saves: tuple[list[int], list[int]] = ([], [])   # this step's, in the block order
        self._lock = threading.Lock()          # the data plane's thread completes what the worker thread holds
        self._held_until: dict[str, float] = {}
        # COMPLETEs by request, and leases that ran out, with when: a COMPLETE often arrives before
        # the step that tells this worker its request is held (the decode instance learnt of it
        # from the output of the step before), so neither waits for the other.
        self._completed: dict[str, float] = {}
        self._expired: dict[str, float] = {}
        self._pulling: dict[str, tuple[Load, Future[TransferReport]]] = {}
        self._in_step: list[tuple[Load, Future[TransferReport]]] = []   # pulls this step waits for
        self._load_errors: set[int] = set()
        self.pulls: deque[tuple[Load, TransferReport]] = deque(maxlen=RECENT_PULLS)   # the latest, for stats
        self.transferred = TransferTotals()   # all pulls, all time

    # -- scheduler side ---------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params or {}
        if not params.get("remote_address"):
            # from the cxl tier, if any: loaded layer by layer in the step
            return (self.tier_plan.lookup(request, num_computed_tokens) if self.tier_plan else 0), False
        # The whole prompt, its last block partly full or not: vLLM computes the last token again, to
        # sample from, as after a full prefix hit (recomputing a whole last block instead cost a 32-token
        # step, 40-50 ms against 14 for one token on `small` here).
        available = min(params["num_tokens"], len(request.prompt_token_ids))
        self._local_tokens[request.request_id] = num_computed_tokens
        external = max(0, available - num_computed_tokens)
        if 0 < external <= self.settings.sync_load_tokens:
            # Pulled in the step that runs it, which must compute a token: the last, to sample from
            # (after an asynchronous load vLLM takes that token back itself).
            return max(0, min(available, request.num_tokens - 1) - num_computed_tokens), False
        return external, external > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self.tier_plan is not None:
            self.tier_plan.after_alloc(request, blocks, num_external_tokens)
        local = self._local_tokens.pop(request.request_id, 0)
        params = request.kv_transfer_params
        if num_external_tokens <= 0 or not (params or {}).get("remote_address"):
            return
        first = local // self.block_size   # blocks found in our own prefix cache come first
        count = blocks_for(local + num_external_tokens, self.block_size) - first
        self._loads.append(Load(request.request_id, params["remote_request_id"], params["remote_address"],
                                list(params["remote_block_ids"][first:first + count]),
                                list(blocks.get_block_ids()[0][first:first + count]),
                                in_step=num_external_tokens <= self.settings.sync_load_tokens))
        params["remote_address"] = None   # loaded once: a preempted request recomputes instead

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVMeshConnectorMetadata(loads=self._loads, held=self._held)
        self._loads, self._held = [], []
        if self.tier_plan is not None:
            meta.tier_loads, meta.tier_saves = self.tier_plan.step(
                scheduler_output, lambda request_id: self._kv_cache_manager.get_block_ids(request_id)[0])
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.tier_plan is not None:
            self.tier_plan.finished(request.request_id)
        params = request.kv_transfer_params or {}
        if not (self._kv_transfer_config.is_kv_producer and params.get("do_remote_decode")) or not block_ids:
            return False, None
        if request.status == RequestStatus.FINISHED_ABORTED:
            return False, None
        self._held.append(request.request_id)
        return True, {"remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
                      "remote_address": f"{self.settings.data_host}:{self.settings.data_port}",
                      "remote_block_ids": list(block_ids), "num_tokens": request.num_computed_tokens}

    # -- worker side ------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        s = self.settings
        if s.cxl_blocks:
            self.tier = HostTier(kv_caches, s.cxl_blocks)
        if not s.handoff:
            return
        # A vLLM layer's cache is a tensor whose first dimension is the block: a block's bytes in every
        # layer are what moves, whatever the attention backend lays out inside it.
        config = self._kv_transfer_config
        self.data_plane = ThreadedNode(KVDirectNode(
            s.backend, s.token, s.data_host, s.data_port,
            served=kv_caches if config.is_kv_producer else None, landing=kv_caches if config.is_kv_consumer else None,
            release=self._on_complete, timeout=s.timeout_s, options=s.endpoint))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVMeshConnectorMetadata)
        with self._lock:
            deadline = time.monotonic() + self.settings.lease_s
            self._held_until.update((request_id, deadline) for request_id in meta.held)
        for load in meta.loads:
            load.started = time.time()
            pull = self.data_plane.pull(load.address, load.remote_request_id,
                                        [BlockReads(name, name, load.remote_blocks, load.local_blocks)
                                         for name in self.kv_caches])
            if load.in_step:
                self._in_step.append((load, pull))
            else:
                self._pulling[load.request_id] = load, pull
        if self.tier is not None:
            if meta.tier_loads[0]:
                self.tier.start_loads(*meta.tier_loads)
            self._tier_saves = meta.tier_saves

    def wait_for_layer_load(self, layer_name: str) -> None:
        # A pull in this step is of every layer: over before the first runs. cxl-tier loads go layer by layer.
        self._finish_in_step_pulls()
        if self.tier is not None:
            self.tier.wait_for_layer(layer_name)

    def _finish_in_step_pulls(self) -> None:
        if not self._in_step:   # called before every layer: most steps pull nothing
            return
        pulls, self._in_step = self._in_step, []
        for load, pull in pulls:
            try:
                self._pulled(load, pull.result())
            except (RdmaError, TimeoutError, OSError) as exc:
                self._pull_failed(load, exc)

    def _pulled(self, load: Load, report: TransferReport) -> None:
        self.pulls.append((load, report))
        self.transferred.add(report)

    def _pull_failed(self, load: Load, exc: Exception) -> None:
        log.warning("pulling the KV of %s from %s failed (%s); vLLM recomputes it", load.remote_request_id,
                    load.address, exc)
        self._load_errors.update(load.local_blocks)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        # Pull mode keeps the KV in place until a decode instance reads it; the cxl tier takes a copy.
        if self.tier is not None and self._tier_saves[0]:
            self.tier.save_layer(layer_name, *self._tier_saves)

    def wait_for_save(self) -> None:
        if self.tier is not None:
            self.tier.wait_for_saves()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(held requests whose KV a decode instance took, or whose lease ran out; requests whose
        pull is over, done or failed)."""
        now = time.monotonic()
        with self._lock:
            sent = {r for r, until in self._held_until.items() if r in self._completed or until <= now}
            for request_id in sent:
                del self._held_until[request_id]
                if self._completed.pop(request_id, None) is None:
                    self._expired[request_id] = now
            # Forget COMPLETEs of requests never held here, and expiries no COMPLETE asked about.
            for seen in (self._completed, self._expired):
                for request_id in [r for r, at in seen.items() if at < now - self.settings.lease_s]:
                    del seen[request_id]
        if self._pulling:
            # vLLM's loop steps without pause while requests wait for their KV, and the data plane's
            # thread needs the GIL to make progress: give it up to PULL_YIELD_S of this step.
            wait([pull for _, pull in self._pulling.values()], PULL_YIELD_S, FIRST_COMPLETED)
        self._finish_in_step_pulls()   # a step that ran no layer did not wait for them
        received = {r for r, (_, pull) in self._pulling.items() if pull.done()}
        for request_id in received:
            load, pull = self._pulling.pop(request_id)
            try:
                self._pulled(load, pull.result())
            except (RdmaError, TimeoutError, OSError) as exc:
                self._pull_failed(load, exc)
        return sent or None, received or None

    def pull_of(self, request_id: str) -> tuple[Load, TransferReport] | None:
        """The latest finished pull of a request (vLLM's id), if one is still remembered."""
        return next(((load, report) for load, report in reversed(self.pulls) if load.request_id == request_id), None)

    @property
    def held(self) -> int:
        """Producer: finished requests whose KV waits for a decode instance."""
        with self._lock:
            return len(self._held_until)

    @property
    def pulling(self) -> int:
        """Consumer: requests whose pull is under way."""
        return len(self._pulling)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        for _, pull in [*self._pulling.values(), *self._in_step]:
            pull.cancel()
        for plane in (self.data_plane, self.tier):
            if plane is not None:
                plane.close()

    def _on_complete(self, request_id: str) -> bool:
        """On the data plane's thread: a decode instance has read `request_id`'s blocks. True when
        they were still ours while it read (held, or about to be: vLLM frees nothing before
        get_finished reports it); False when the lease had run out and they were freed."""
        with self._lock:
            if request_id in self._expired:
                return False
            self._completed[request_id] = time.monotonic()
            return True
