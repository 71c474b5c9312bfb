"""The planner's search (sim/plan.py): the configurations tried, the SLOs, and each configuration's
goodput, found by bisection on the simulator.

Goodput is DistServe's (OSDI'24, section 2.2): the highest arrival rate at which at least X% of
requests meet every SLO. Every run is the same workload: the same seed draws the same lengths and the
same exponential gaps, scaled by the rate, so two configurations, or two rates, are compared on the
same requests (paired). With conversations (plan_workload.py) the rate is conversations started per
second, and the goodput the highest such rate at which X% of their turns meet every SLO. Every request
counts: one admission's front door refused meets no SLO."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from kvmesh.policies import registry as engine_policies
from kvmesh.policies.admission import AdmissionLimits
from kvmesh.policies.routing import registry as routing_policies

from .admission import AdmittedCluster
from .cache_choice import CACHES, cache_figures, with_cache
from .cluster import HEARTBEAT_S, TRANSFER_MODES, Cluster, build
from .conversations import Conversations, ConversationLoop
from .engine import HOOKS as ENGINE_HOOKS
from .engine import EngineSpec
from .front_door import FrontDoor
from .link import KVGeometry, LinkSpec
from .metrics import slo_attainment, summarise
from .request import SimRequest
from .step_cost import StepCost
from .topology import Topology
from .plan_layers import POLICIES as LAYERKV_POLICIES
from .plan_layers import layered, layerkv_spec
from .plan_workload import planned_requests, planned_turns
from .workload import Lengths

SLOS = ("ttft", "tpot", "e2e")
KINDS = ("colocated", "pd")
DOUBLINGS = 10  # the bracket's search stops 2**10 times above or below the starting rate
SEARCHED = ("kv_allocation", "preemption_order", "preemption_strategy")  # the engine hooks the search varies
ROUTINGS = ("conditional", "least_loaded", "round_robin")  # searched by default (and prefix_aware: routing_choices)
FRONT_DOORS = ("off", "on")  # admission's front door, searched (front_door_choices)
LAYER_OFFLOADS = ("none", "layerkv")  # LayerKV's layers and Algorithm 1, searched (layer_offload_choices)


def parse_slos(texts: Iterable[str]) -> dict[str, float]:
    """`NAME=LIMIT` each, or several joined by commas: NAME one of SLOS, LIMIT in milliseconds (`250`,
    `250ms`) or seconds (`0.25s`). Seconds by name."""
    slos = {}
    for item in (part.strip() for text in texts for part in text.split(",")):
        name, _, limit = item.partition("=")
        seconds = limit.endswith("s") and not limit.endswith("ms")
        try:
            value = float(limit.removesuffix("ms").removesuffix("s")) * (1.0 if seconds else 1e-3)
        except ValueError:
            value = math.nan
        if name not in SLOS or not math.isfinite(value) or value <= 0:
            raise ValueError(f"SLO {item!r}: give NAME=LIMIT, NAME one of {', '.join(SLOS)}, LIMIT above 0 in ms "
                             f"(250 or 250ms) or seconds (0.25s); e.g. --slo ttft=250 --slo tpot=25")
        slos[name] = value
    if not slos:
        raise ValueError(f"no SLO given: give at least one of {', '.join(SLOS)}, e.g. --slo ttft=250 --slo tpot=25")
    return slos


def parse_counts(text: str) -> list[int]:
    """Engine counts: `N`, `LOW-HIGH` or a comma-separated list of either."""
    counts: set[int] = set()
    for part in text.split(","):
        low, _, high = part.strip().partition("-")
        high = high or low
        if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
            raise ValueError(f"engine counts {text!r}: give N, LOW-HIGH or a comma-separated list, each at least 1")
        counts.update(range(int(low), int(high) + 1))
    return sorted(counts)


@dataclass(frozen=True, slots=True)
class Candidate:
    """One configuration: its engines and roles, and the policies it runs."""

    topology: Topology
    routing: str
    preemption_order: str
    transfer_mode: str | None = None  # disaggregated topologies only
    kv_allocation: str = "block_at_a_time"
    preemption_strategy: str = "recompute"
    cache: str | None = None  # the prefix cache (cache_choice.py); None: not searched, no blocks shared
    front_door: bool = False  # admission's front door, its limits from the SLOs (door_limits)
    layerkv: bool = False     # LayerKV's layer offload and Algorithm 1 (plan_layers.py); else fcfs, every layer kept

    @property
    def engines(self) -> int:
        return self.topology.colocated + self.topology.prefill + self.topology.decode

    @property
    def engine_policies(self) -> dict[str, str]:
        return {hook: getattr(self, hook) for hook in SEARCHED}

    def __str__(self) -> str:
        cache = None if self.cache is None else f"cache:{self.cache}"
        door = "front_door" if self.front_door else None
        layers = "layerkv" if self.layerkv else None
        return " ".join(str(part) for part in (self.topology, self.routing, self.transfer_mode, door, layers, cache,
                                               self.kv_allocation, self.preemption_order, self.preemption_strategy)
                        if part is not None)


def engine_choices(policies: dict[str, str], searched: dict[str, list[str]],
                   cxl_tier: bool) -> tuple[dict[str, str], dict[str, list[str]]]:
    """The engine policies every configuration runs, and the names searched for each hook of SEARCHED.
    `--policy HOOK=NAME` fixes a searched hook to NAME; without a cxl tier a swap has nowhere to go, so
    the preemption strategy is not searched (recompute, the only one that can happen)."""
    unknown = set(policies) - set(ENGINE_HOOKS)
    if unknown:
        raise ValueError(f"the simulator runs the engine hooks {', '.join(ENGINE_HOOKS)}; "
                         f"not {', '.join(sorted(unknown))}")
    for hook, name in policies.items():
        engine_policies.resolve(hook, name)
    if policies.get("layer_offload", "none") != "none":
        raise ValueError("layer_offload is searched by --layer-offloads, with the staging area and fits it needs "
                         "(plan_layers.py); not given by --policy")
    choices = {hook: [policies[hook]] if hook in policies else list(searched[hook]) for hook in SEARCHED}
    for hook, names in choices.items():
        for name in names:
            engine_policies.resolve(hook, name)  # a KeyError naming the known ones
    if not cxl_tier and "preemption_strategy" not in policies:
        choices["preemption_strategy"] = ["recompute"] if choices["preemption_strategy"] else []
    return {hook: name for hook, name in policies.items() if hook not in SEARCHED}, choices


def routing_choices(routings: Sequence[str] | None, shares_blocks: bool) -> list[str]:
    """The routings searched: those given, else ROUTINGS and, where requests share blocks (a cache can
    hold a prompt's prefix), prefix_aware, which routes to it."""
    if routings is not None:
        return list(routings)
    return [*ROUTINGS, "prefix_aware"] if shares_blocks else list(ROUTINGS)


def cache_choices(caches: Sequence[str], shares_blocks: bool, cxl_tier: bool) -> list[str | None]:
    """The prefix caches searched (cache_choice.py's names): none at all where no two requests share a
    block (a cache would find nothing: the dimension is left out, [None]); car only with a cxl tier."""
    unknown = [name for name in caches if name not in CACHES]
    if unknown:
        raise ValueError(f"cache {unknown[0]!r}: the caches are {', '.join(CACHES)}")
    if not shares_blocks:
        return [None]
    return [name for name in caches if name != "car" or cxl_tier]


def front_door_choices(names: Sequence[str], slos: dict[str, float]) -> list[bool]:
    """Whether admission's front door stands in front, each of FRONT_DOORS given: on only with a TTFT or
    end-to-end SLO, which its refusal by expected wait reads (door_limits); a TPOT SLO holds however
    long a request waits, so refusing one cannot help it."""
    unknown = [name for name in names if name not in FRONT_DOORS]
    if unknown:
        raise ValueError(f"front door {unknown[0]!r}: give {' or '.join(FRONT_DOORS)}")
    return [name == "on" for name in names if name == "off" or "ttft" in slos or "e2e" in slos]


def layer_offload_choices(names: Sequence[str], spec: EngineSpec, geometry: KVGeometry) -> list[bool]:
    """Whether the engines run LayerKV, each of LAYER_OFFLOADS given: layerkv only where the engine
    spec can (plan_layers.layered: a cxl tier, the geometry's layers)."""
    unknown = [name for name in names if name not in LAYER_OFFLOADS]
    if unknown:
        raise ValueError(f"layer offload {unknown[0]!r}: give {' or '.join(LAYER_OFFLOADS)}")
    missing = layered(spec, geometry)
    if list(names) == ["layerkv"] and missing is not None:
        raise ValueError(f"LayerKV's layer offload needs {missing}")
    return [name == "layerkv" for name in names if name == "none" or missing is None]


def door_limits(slos: dict[str, float], engines: int, spec: EngineSpec) -> AdmissionLimits:
    """Admission's limits for a front door the planner runs: a request is refused when it can expect to
    wait for its first token past its TTFT SLO (every request carries it), else past the end-to-end
    SLO; as many run at once as the engines batch (each `max_num_seqs`), the rest wait in admission's
    queue (its default bound); no rate limit."""
    return AdmissionLimits(max_running=engines * spec.max_num_seqs, max_wait_s=slos.get("e2e"))


def search_space(engine_counts: Sequence[int], kinds: Sequence[str], routings: Sequence[str],
                 transfer_modes: Sequence[str], engine_searched: dict[str, list[str]],
                 caches: Sequence[str | None] = (None,), front_doors: Sequence[bool] = (False,),
                 layer_offloads: Sequence[bool] = (False,)) -> list[Candidate]:
    """Every topology of each engine count (colocated:N; pd:P:D for every P + D = N) with every policy
    choice (routing, transfer mode, front door, LayerKV, prefix cache, and each hook of SEARCHED);
    transfer modes only where a KV hand-off happens, every cache on every topology, LayerKV
    without a prefix cache (the simulator counts one or the other). In that order, so a tie goes to
    the configuration listed first."""
    unknown = [kind for kind in kinds if kind not in KINDS] + [m for m in transfer_modes if m not in TRANSFER_MODES]
    if unknown:
        raise ValueError(f"{unknown[0]!r}: topologies are {' and '.join(KINDS)}, transfer modes "
                         f"{' and '.join(TRANSFER_MODES)}")
    for name in routings:
        routing_policies.resolve(name)  # a KeyError naming the known ones
    allocations, orders, strategies = (engine_searched[hook] for hook in SEARCHED)
    space = []
    for n in engine_counts:
        topologies = ([Topology(colocated=n)] if "colocated" in kinds else []) + \
            ([Topology(prefill=p, decode=n - p) for p in range(1, n)] if "pd" in kinds else [])
        for topology in topologies:
            modes = transfer_modes if topology.prefill else [None]
            space += [Candidate(topology, routing, order, mode, allocation, strategy, cache, door, layers)
                      for routing, mode, door, layers, cache, allocation, order, strategy in
                      itertools.product(routings, modes, front_doors, layer_offloads,
                                        caches, allocations, orders, strategies)
                      if not layers or cache in (None, "none")]
    if not space:
        raise ValueError(f"the search space is empty: engine counts {list(engine_counts)}, topologies {list(kinds)}, "
                         f"routing {list(routings)}, transfer modes {list(transfer_modes)}, caches {list(caches)}, "
                         f"front doors {list(front_doors)}, layer offloads {list(layer_offloads)}, "
                         f"engine policies {engine_searched} (pd needs 2 engines or more; car a cxl tier)")
    return space


@dataclass(frozen=True, slots=True)
class Goodput:
    rate: float                # the highest rate found to meet the target (0: none down to the floor)
    failed_at: float | None    # the lowest rate found to miss it (None: none up to the ceiling)
    probes: tuple[tuple[float, float], ...]  # (rate, attainment), in the order they ran


def bisect_goodput(attainment: Callable[[float], float], target: float, start: float,
                   tolerance: float = 0.02) -> Goodput:
    """The highest rate whose attainment is at least `target`, taking attainment to fall as the rate
    grows: from `start`, double (or halve) until two rates bracket it, then halve the bracket until
    its width is at most `tolerance` of its top."""
    probes: list[tuple[float, float]] = []

    def meets(rate: float) -> bool:
        probes.append((rate, attainment(rate)))
        return probes[-1][1] >= target

    if meets(start):
        low, high = start, None
        for _ in range(DOUBLINGS):
            if not meets(2 * low):
                high = 2 * low
                break
            low *= 2
        else:
            return Goodput(low, None, tuple(probes))
    else:
        low, high = 0.0, start
        for _ in range(DOUBLINGS):
            if meets(high / 2):
                low = high / 2
                break
            high /= 2
        else:
            return Goodput(0.0, high, tuple(probes))
    while high - low > tolerance * high:
        middle = (low + high) / 2
        low, high = (middle, high) if meets(middle) else (low, middle)
    return Goodput(low, high, tuple(probes))


@dataclass(frozen=True, slots=True)
class Run:
    """One configuration at one rate: the fraction meeting each SLO (and `all`), and the figures."""

    attainment: dict[str, float]
    ttft_p90_s: float | None
    tpot_mean_s: float | None
    e2e_p90_s: float | None
    preemptions: int
    unfinished: int
    cache: dict | None = None  # with a prefix cache: what it gave (cache_choice.cache_figures)
    refused: int | None = None  # with a front door: the requests (turns) it refused


class Simulator:
    """Runs a configuration at a rate on the planner's one workload, each (configuration, rate) once.
    A run in which nobody was preempted never called the preemption order or strategy, so it stands
    for every order and strategy: the others reuse it (`shared` counts them). With `conversation` the
    workload is its turns, closed-loop (plan_workload.planned_turns), the rate conversations a second."""

    def __init__(self, prompt: Lengths, output: Lengths, requests: int, seed: int, slos: dict[str, float],
                 spec: EngineSpec, cost: StepCost, link: LinkSpec = LinkSpec(), geometry: KVGeometry = KVGeometry(),
                 heartbeat_s: float = HEARTBEAT_S, policies: dict[str, str] | None = None,
                 conversation: Conversations | None = None):
        self.prompt, self.output, self.requests, self.seed, self.slos = prompt, output, requests, seed, slos
        self.conversation = conversation
        self.policies = dict(policies or {})  # every configuration's engine policies but the searched ones
        if set(self.policies) & set(SEARCHED):  # a candidate names its own: one given here would be overridden
            raise ValueError(f"the candidates name {', '.join(SEARCHED)}; give the others only")
        self.spec, self.cost, self.link, self.geometry, self.heartbeat_s = spec, cost, link, geometry, heartbeat_s
        self.runs: dict[tuple[Candidate, float], Run] = {}
        self.simulated = self.shared = 0

    def run(self, candidate: Candidate, rate: float) -> Run:
        key, any_order = (candidate, rate), (replace(candidate, preemption_order="", preemption_strategy=""), rate)
        if key not in self.runs and any_order in self.runs:
            self.runs[key] = self.runs[any_order]
            self.shared += 1
        if key in self.runs:
            return self.runs[key]
        workload, cluster = self._cluster(candidate, rate)
        summary = summarise(workload, cluster.run(workload), 0.0)
        self.runs[key] = run = Run(slo_attainment(workload, self.slos), summary["ttft_p90_s"], summary["tpot_mean_s"],
                                   summary["e2e_p90_s"], summary["preemptions"], summary["unfinished"],
                                   cache_figures(workload, cluster),
                                   len(cluster.door.refused) if isinstance(cluster, AdmittedCluster) else None)
        self.simulated += 1
        if run.preemptions == 0:
            self.runs[any_order] = run
        return run

    @property
    def unit(self) -> str:
        """What a rate counts: requests, or conversations started, a second."""
        return "req/s" if self.conversation is None else "conv/s"

    def _cluster(self, candidate: Candidate, rate: float) -> tuple[list[SimRequest], Cluster]:
        """The run's requests, and the cluster that serves them with the candidate's policies, cache and
        front door."""
        spec = layerkv_spec(self.spec, self.cost, self.geometry) if candidate.layerkv else self.spec
        spec, cache_policies = (spec, {}) if candidate.cache is None else with_cache(spec, candidate.cache)
        policies = self.policies | cache_policies | candidate.engine_policies | \
            (LAYERKV_POLICIES if candidate.layerkv else {})
        cluster = dict(routing=candidate.routing, link=self.link, geometry=self.geometry,
                       transfer_mode=candidate.transfer_mode or "pull", heartbeat_s=self.heartbeat_s)
        if self.conversation is None:
            workload, talks = planned_requests(rate, self.requests, self.prompt, self.output, self.seed, self.slos,
                                               candidate.kv_allocation), None
        else:
            talks = planned_turns(rate, self.requests, self.conversation, spec.block_size, self.seed, self.slos,
                                  candidate.kv_allocation)
            workload = [request for talk in talks for request, _ in talk]
        if candidate.front_door:
            door = FrontDoor(door_limits(self.slos, candidate.engines, spec))
            return workload, AdmittedCluster.build(candidate.topology, spec, self.cost, policies, door, talks,
                                                   **cluster)
        if talks is None:
            return workload, build(candidate.topology, spec, self.cost, policies, **cluster)
        return workload, ConversationLoop.build(candidate.topology, spec, self.cost, policies, talks, **cluster)

