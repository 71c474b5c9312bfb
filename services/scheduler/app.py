"""The scheduler: `POST /v1/route` picks a (prefill, decode) pair, or one colocated engine, with the
routing policy in force; `GET /v1/cluster`; `GET`/`PUT /v1/policy` (docs/serving.md).

It reads kvmeta only: membership from the watch stream, load from the registry every
`load_refresh_s`, and per route the cache table for the prompt's NodeIDs.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import GaugeMetricFamily

from kvmesh.libs.controlplane import BadRequest, KvmeshError, Service, ServiceConfig, ServiceUnavailable, cancel_and_wait
from kvmesh.libs.kvmeta.client import KvmetaClient
from kvmesh.libs.kvmeta.messages import WorkerInfo
from kvmesh.libs.kvmeta.nodeid import node_ids
from kvmesh.libs.messages.scheduler import ClusterView, PolicyChoice, PolicyInfo, Route, RouteRequest, WorkerRef
from kvmesh.policies.routing import registry
from kvmesh.policies.routing.views import RouteDecision, RouteQuery, RoutingPolicy, RoutingState

from .errors import NoEngine, UnknownModel
from .cluster import LiveCluster

# A route asked of a scheduler that has no snapshot of the engines yet waits for it this long: with the
# listening socket held across a restart (kvmesh up), requests reach the new process as it starts.
FIRST_SNAPSHOT_WAIT_S = 5.0

log = logging.getLogger(__name__)


class Config(ServiceConfig, kw_only=True):
    port: int = 8102
    kvmeta_url: str = "http://127.0.0.1:8103"
    policy: str = registry.DEFAULT
    # Engines report load every heartbeat (ttl/3, over a second by default): reading it more often
    # than this gains nothing, and a route never waits for it.
    load_refresh_s: float = 0.1

    def __post_init__(self) -> None:
        if self.policy not in registry.names():
            raise ValueError(f"policy {self.policy!r} is not one of {', '.join(registry.names())}")


@dataclass
class PolicyInForce:
    name: str
    decide: RoutingPolicy
    state: RoutingState = field(default_factory=RoutingState)  # kept across switches


class SchedulerRoutes:
    """The scheduler's routes, one method each, and what they share: the engines it follows in kvmeta
    and the routing policy in force."""

    def __init__(self, config: Config, metrics: CollectorRegistry):
        self.config = config
        self.kvmeta = KvmetaClient(config.kvmeta_url, config.token)
        self.cluster = LiveCluster()
        self.current = PolicyInForce(config.policy, registry.resolve(config.policy))
        self.tasks: list[asyncio.Task] = []
        self.routes_answered = Counter("kvmesh_scheduler_routes", "Routes answered, by policy and mode "
                                       "(no_engine: none found)", ["policy", "mode"], registry=metrics)
        metrics.register(EnginesByState(self.cluster))

    async def follow_kvmeta(self, app: web.Application) -> AsyncIterator[None]:
        self.tasks.extend([asyncio.create_task(self.cluster.follow(self.kvmeta)),
                           asyncio.create_task(self.cluster.poll_loads(self.kvmeta, self.config.load_refresh_s))])
        yield
        await cancel_and_wait(self.tasks)
        await self.kvmeta.close()

    async def registry_known(self) -> None:
        for task in self.tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise ServiceUnavailable(f"following kvmeta at {self.config.kvmeta_url} failed: {task.exception()}")
        if not self.cluster.synced.is_set():
            raise ServiceUnavailable(f"no worker snapshot from kvmeta at {self.config.kvmeta_url} yet")

    async def route(self, request: web.Request, body: RouteRequest) -> Route:
        """Pick a (prefill, decode) pair, or one colocated engine, for a prompt."""
        if not self.cluster.synced.is_set():  # a route asked of a process just (re)started, before it knows the engines
            try:
                await asyncio.wait_for(self.cluster.synced.wait(), FIRST_SNAPSHOT_WAIT_S)
            except TimeoutError:
                raise ServiceUnavailable(f"no worker snapshot from kvmeta at {self.config.kvmeta_url} yet") from None
        cached = await self.cached_blocks(body)
        query = RouteQuery(model=body.model, prompt_tokens=len(body.prompt_token_ids),
                           exclude=frozenset(body.exclude))
        decision, self.current.state = self.current.decide(query, self.cluster.views(cached), self.current.state)
        workers = {engine_id: m.info for engine_id, m in self.cluster.members.items()}
        if decision is None:
            if body.model not in self.cluster.models_seen:
                self.routes_answered.labels(self.current.name, "unknown_model").inc()
                raise UnknownModel(_no_engine_message(body, workers.values()))
            self.routes_answered.labels(self.current.name, "no_engine").inc()
            raise NoEngine(_no_engine_message(body, workers.values()))
        for engine_id in (decision.prefill, decision.decode, decision.engine):
            if engine_id is not None:
                self.cluster.routed(engine_id, query.prompt_tokens)
        self.routes_answered.labels(self.current.name, decision.mode).inc()
        return _route(decision, self.current.name, workers)

    async def cluster_view(self, request: web.Request) -> ClusterView:
        """The live engines with their load, and the policy in force."""
        return ClusterView(policy=self.current.name, engines=self.cluster.status())

    async def get_policy(self, request: web.Request) -> PolicyInfo:
        """The routing policy in force and the ones to choose from."""
        return PolicyInfo(policy=self.current.name, available=registry.names())

    async def set_policy(self, request: web.Request, body: PolicyChoice) -> PolicyInfo:
        """Switch the routing policy; the next route uses it."""
        current = self.current
        try:
            policy = registry.resolve(body.policy)
        except KeyError as exc:
            raise BadRequest(str(exc.args[0])) from None
        if body.policy != current.name:
            log.info("routing policy: %s -> %s", current.name, body.policy)
        current.name, current.decide = body.policy, policy
        return PolicyInfo(policy=body.policy, available=registry.names())

    async def cached_blocks(self, body: RouteRequest) -> dict[str, tuple[int, int]]:
        """Leading blocks of the prompt each engine that could prefill it holds, and of those how many
        in its device tier; {} if kvmeta cannot say.
        Looked up whatever the policy, so every route reports what its prefill engine will reuse
        (one kvmeta call, under a millisecond)."""
        cluster = self.cluster
        sizes = {m.info.geometry.block_size for m in cluster.members.values()
                 if m.info.model == body.model and m.info.role != "decode"}
        cached: dict[str, tuple[int, int]] = {}
        for size in sorted(sizes):
            ids = node_ids(body.prompt_token_ids, size, body.model)
            if not ids:
                continue
            try:
                matches = await self.kvmeta.lookup(ids)
            except KvmeshError as exc:
                log.warning("routing without the cache table: %s", exc)
                return {}
            holders = {engine_id for engine_id, m in cluster.members.items() if m.info.geometry.block_size == size}
            cached.update({match.engine: (match.blocks, match.device_blocks) for match in matches
                           if match.engine in holders})
        return cached


def build_service(config: Config) -> Service:
    service = Service("scheduler", config)
    scheduler = SchedulerRoutes(config, service.metrics)
    service.lifespan(scheduler.follow_kvmeta)
    service.readiness(scheduler.registry_known)

    service.route("POST", "/v1/route", body=RouteRequest, response=Route)(scheduler.route)
    service.route("GET", "/v1/cluster", response=ClusterView)(scheduler.cluster_view)
    service.route("GET", "/v1/policy", response=PolicyInfo)(scheduler.get_policy)
    service.route("PUT", "/v1/policy", body=PolicyChoice, response=PolicyInfo)(scheduler.set_policy)
    return service


class EnginesByState:
    """A prometheus collector: the live engines the scheduler knows, by role and state, when scraped."""

    ROLES = ("prefill", "decode", "both")
    STATES = ("idle", "busy")  # busy: its last load report, or routes sent since, has requests

    def __init__(self, cluster: LiveCluster):
        self.cluster = cluster

    def collect(self) -> Iterator[GaugeMetricFamily]:
        counts = Tally((m.info.role, "busy" if m.load.waiting + m.load.running + m.routed else "idle")
                       for m in self.cluster.members.values())
        family = GaugeMetricFamily("kvmesh_scheduler_engines", "Live engines the scheduler knows, by role and state "
                                   "(busy: waiting or running requests reported, or routed since)",
                                   labels=["role", "state"])
        for role in self.ROLES:
            for state in self.STATES:
                family.add_metric([role, state], counts[(role, state)])
        yield family


def _route(decision: RouteDecision, policy: str, workers: Mapping[str, WorkerInfo]) -> Route:
    def ref(engine_id: str | None) -> WorkerRef | None:
        if engine_id is None:
            return None
        worker = workers[engine_id]
        return WorkerRef(id=worker.id, control_url=worker.control_url, data_address=worker.data_address,
                         role=worker.role)

    return Route(mode=decision.mode, prefill=ref(decision.prefill), decode=ref(decision.decode),
                 engine=ref(decision.engine), policy=policy, cached_blocks=decision.cached_blocks)


def _no_engine_message(body: RouteRequest, live: Iterable[WorkerInfo]) -> str:
    live = list(live)
    serving = sorted(f"{w.id} ({w.role})" for w in live if w.model == body.model and w.id not in body.exclude)
    if serving:
        return (f"model {body.model!r} has no live prefill/decode pair and no colocated engine: "
                f"only {', '.join(serving)}" + (f" (excluded: {', '.join(body.exclude)})" if body.exclude else ""))
    if any(w.model == body.model for w in live):
        return f"every live engine of model {body.model!r} is excluded ({', '.join(body.exclude)})"
    models = sorted({w.model for w in live})
    return (f"no live engine serves model {body.model!r}; live engines serve: "
            f"{', '.join(repr(m) for m in models) if models else 'nothing (no engine is registered)'}")
