"""The scheduler's live picture of the cluster: who is up (kvmeta's watch stream: a snapshot, then
join and leave), their load (kvmeta's registry, polled), and what the scheduler routed to each engine
since that engine's last heartbeat.

Engines report load only in heartbeats (every ttl/3), so between two reports every route would go
to the same "least loaded" engine. Counting what was routed since the report, as waiting requests
and as the device blocks their prompts take, spreads a burst until the next report replaces it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from kvmesh.libs.controlplane import KvmeshError
from kvmesh.libs.kvmeta.client import KvmetaClient
from kvmesh.libs.kvmeta.messages import Load, Worker, WorkerEvent, WorkerInfo
from kvmesh.libs.messages.scheduler import EngineStatus
from kvmesh.policies.routing.views import EngineLoad, EngineView


log = logging.getLogger(__name__)


@dataclass
class Member:
    info: WorkerInfo
    load: Load
    heartbeat_ms: int = 0     # when `load` was reported
    routed: int = 0           # routes sent here since then
    routed_blocks: int = 0    # device blocks their prompts take

    def free_device_blocks(self) -> int:
        """Reported free device blocks (all of them before a first report) less what was routed since."""
        reported = self.load.free_blocks.get("device", self.info.capacity.device_blocks)
        return max(0, reported - self.routed_blocks)


class LiveCluster:
    def __init__(self) -> None:
        self.members: dict[str, Member] = {}
        self.models_seen: set[str] = set()  # every model a member served since start: known, if not live
        self.synced = asyncio.Event()  # set by the first snapshot

    # -- keeping up with kvmeta -------------------------------------------------------------------

    async def follow(self, kvmeta: KvmetaClient) -> None:
        """Apply the watch stream forever (the client reconnects, each time from a fresh snapshot)."""
        async for event in kvmeta.watch():
            self.apply(event)

    async def poll_loads(self, kvmeta: KvmetaClient, interval: float) -> None:
        failing = False
        while True:
            try:
                self.update_loads(await kvmeta.workers())
                failing = False
            except KvmeshError as exc:
                if not failing:
                    log.warning("cannot read engine load from kvmeta: %s", exc)
                failing = True
            await asyncio.sleep(interval)

    def apply(self, event: WorkerEvent) -> None:
        if event.kind == "snapshot":
            self.members = {w.info.id: Member(w.info, w.load, w.heartbeat_ms) for w in event.workers or []}
            self.models_seen.update(w.info.model for w in event.workers or [])
            self.synced.set()
        elif event.kind == "join" and event.worker is not None:
            self.members[event.worker.id] = Member(event.worker, Load(), event.at_ms)  # registered without load
            self.models_seen.add(event.worker.model)
        elif event.kind == "leave" and event.worker_id is not None:
            self.members.pop(event.worker_id, None)

    def update_loads(self, workers: Iterable[Worker]) -> None:
        """Take newer load reports; membership stays the watch stream's to decide."""
        for worker in workers:
            member = self.members.get(worker.info.id)
            if member is not None and member.info == worker.info and worker.heartbeat_ms > member.heartbeat_ms:
                self.members[worker.info.id] = Member(worker.info, worker.load, worker.heartbeat_ms)

    # -- what routing reads and writes ------------------------------------------------------------

    def views(self, cached: dict[str, tuple[int, int]]) -> list[EngineView]:
        """What routing sees of each member; `cached`: its leading blocks of the prompt, and of those
        how many are in its device tier."""
        return [EngineView(id=m.info.id, role=m.info.role, model=m.info.model, block_size=m.info.geometry.block_size,
                           kv_layout=(m.info.backend, m.info.geometry),
                           load=EngineLoad(free_device_blocks=m.free_device_blocks(),
                                           total_device_blocks=m.info.capacity.device_blocks,
                                           waiting=m.load.waiting + m.routed, running=m.load.running),
                           cached_blocks=cached.get(m.info.id, (0, 0))[0],
                           cached_device_blocks=cached.get(m.info.id, (0, 0))[1])
                for m in self.members.values()]

    def routed(self, engine_id: str, prompt_tokens: int) -> None:
        """A route sent a prompt of `prompt_tokens` to this engine."""
        member = self.members.get(engine_id)
        if member is not None:
            geometry = member.info.geometry
            member.routed += 1
            member.routed_blocks += -(-prompt_tokens // geometry.block_size) * geometry.num_layers

    def status(self) -> list[EngineStatus]:
        return [EngineStatus(id=m.info.id, role=m.info.role, model=m.info.model, control_url=m.info.control_url,
                             data_address=m.info.data_address, free_blocks=dict(m.load.free_blocks),
                             total_device_blocks=m.info.capacity.device_blocks, waiting=m.load.waiting,
                             running=m.load.running, routed_since_heartbeat=m.routed)
                for m in sorted(self.members.values(), key=lambda m: m.info.id)]
