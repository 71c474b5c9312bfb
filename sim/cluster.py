"""A simulated cluster: engines of roles `both`, `prefill` and `decode`, a routing policy from
policies/routing called as the scheduler calls it, and the KV hand-off in pull or push mode over
links (sim/link.py; each prefill engine's shared by its pairs, sim/shared_link.py), in one event loop
where each engine steps on its own.

A request routed to a pair runs in two parts, as admission sends them (docs/serving.md): on the
prefill engine its prompt with `max_tokens` 1, the KV held when it ends; then, from its first token
on, on the decode engine the prompt and first token with `max_tokens` - 1 and the prompt's KV
elsewhere. The decode engine admits it by giving it blocks, the pull takes the link's time, the
prefill engine frees its blocks at the COMPLETE, and the request decodes from its last prompt
token. The request given to `run` is the record across both: arrival, first token, later tokens,
finish, and `transfer_s`. A request of one output token needs no decode engine: it runs whole on
the prefill engine. Both parts carry the request's block names, so each engine's prefix cache does
what the native engine's does: the prefill engine looks the prompt up and commits its blocks (cached
still after the hand-off), the decode engine commits the pulled prompt's blocks as the pull lands but
never looks a pull up (the record takes the prefill part's cached tokens).

Push mode: the decode part goes to its engine first, as the reservation (`POST /v1/kv/reserve`); when
that engine gives it blocks, the prefill part starts, and its chunks' KV is written layer by layer
as each step computes them (queued on the link as the step starts, each layer's for when the step
reaches its end). The first token comes out when the last write is ACKed (the prefill's last frame
comes after the writes); then the prefill engine frees its blocks and the decode part runs from its
last prompt token. `transfer_s` is then what the writes add after the prefill. The
prefill part carries `push` (its decode engine), so a prefill engine with LayerKV keeps every layer
of a pushed prompt on the device, as the native scheduler does.

An engine whose next steps are all decodes that change nothing but the requests' lengths (and end
some) takes them as one decode run (decode_run.py): an arrival joins it when the scheduler's decision
about it is known, anything else added to the engine (or a pull landing) cuts it short, and a
heartbeat reads the load it has reached without cutting it; `max_run_steps` 0 steps every engine one
step at a time (the same events, slower)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from kvmesh.policies.routing import registry
from kvmesh.policies.routing.table import EngineTable
from kvmesh.policies.routing.views import EngineLoad, EngineView, RouteQuery, RoutingState
from kvmesh.policies.views import blocks_for

from . import decode_run
from .decode_run import DecodeRun
from .engine import EngineSpec, SimEngine, Step
from .events import EventQueue, collector_paused
from .link import KVGeometry, LinkSpec, pull, push
from .prefix_count import PrefixCount
from .request import SimRequest
from .shared_link import SharedLink
from .step_cost import StepCost
from .topology import Topology
from .view_builders import build_load, build_view

ARRIVAL, STEP_DONE, RUN_DONE, PULL_DONE, PUSH_DONE = "arrival", "step_done", "run_done", "pull_done", "push_done"
TRANSFER_MODES = ("pull", "push")
HEARTBEAT_S = 1.0  # an engine heartbeats every heartbeat_ttl_ms / 3 (services/engine/config.py: 3,000 ms)
MODEL = "sim"  # every engine serves the one model routing is asked about
MAX_RUN_STEPS = 4096  # the longest decode run (its steps are costed out as they pass: decode_run.py)


@dataclass
class Member:
    role: str
    engine: SimEngine
    busy: bool = False
    report: EngineLoad | None = None  # its load at its last heartbeat
    routed: int = 0                   # routes sent here since then
    routed_blocks: int = 0            # device blocks their prompts take
    run: DecodeRun | None = None      # the decode run it is in


@dataclass(eq=False)
class Handoff:
    """A request split across a pair: its record, and each part on its engine (its transfers' owner
    on the prefill engine's link)."""

    whole: SimRequest
    prefill: str
    decode: str
    prefill_part: SimRequest
    decode_part: SimRequest | None = None
    transfer_start: float | None = None  # pull: its start; push: the prefill's end
    acked_at: float | None = None        # when its transfers queued so far are ACKed, as the link plays now
    version: int = 0                     # of acked_at: a PULL_DONE or PUSH_DONE for an older one is stale


class Cluster:
    def __init__(self, engines: Mapping[str, tuple[str, SimEngine]], routing: str = registry.DEFAULT,
                 link: LinkSpec = LinkSpec(), geometry: KVGeometry = KVGeometry(), transfer_mode: str = "pull",
                 heartbeat_s: float = HEARTBEAT_S, max_run_steps: int = MAX_RUN_STEPS):
        """`engines`: id -> (role, engine); routing: a policy name of policies/routing/registry.py;
        heartbeat_s: how often engines report their load (0: routing sees it as it is); max_run_steps:
        the most steps an engine takes as one decode run (0: none)."""
        if transfer_mode not in TRANSFER_MODES:
            raise ValueError(f"transfer mode {transfer_mode!r}: {' or '.join(TRANSFER_MODES)}")
        if heartbeat_s < 0:
            raise ValueError(f"heartbeat_s must be 0 or more, got {heartbeat_s}")
        self.transfer_mode, self.heartbeat_s, self.max_run_steps = transfer_mode, heartbeat_s, max_run_steps
        self.events = EventQueue()
        self.reported_at: float | None = None  # the heartbeat the engines' reports are from (all alike)
        self.members = {engine_id: Member(role, engine) for engine_id, (role, engine) in engines.items()}
        # Each engine as routing last saw it: a report renews them all, a route the one it went to.
        self.table = EngineTable()
        self.routing = routing
        self.route = registry.resolve(routing)
        self.routing_state = RoutingState()
        self.queries: dict[int, RouteQuery] = {}  # by prompt length: a query is frozen, one serves every arrival
        self.link, self.geometry = link, geometry
        self.links: dict[str, SharedLink] = {}  # prefill engine -> its link
        self.handoffs: dict[str, Handoff] = {}

    def run(self, requests: Iterable[SimRequest], routed: Callable[[SimRequest], None] | None = None) -> float:
        """Route and serve every request; the simulated time when the last event happened. A request
        an engine can never hold stays unfinished (its finished_at None). `routed`, if given, is
        called with each request once it is routed and handed to its engine (bench sim_scale times
        the arrival window with it)."""
        with collector_paused():
            return self._play(requests, routed)

    def _play(self, requests: Iterable[SimRequest], routed: Callable[[SimRequest], None] | None) -> float:
        self.events = events = EventQueue()
        self.reported_at = None
        events.schedule_all(ARRIVAL, ((request.arrival, request) for request in requests))
        while events:
            event = events.pop()
            if event.kind == ARRIVAL:
                request = self.admitted(event.payload)
                touched = [] if request is None else self._arrive(request)
                if routed is not None and request is not None:
                    routed(request)
            elif event.kind == STEP_DONE:
                touched = self._step_done(*event.payload, events)
            elif event.kind == RUN_DONE:
                touched = self._run_done(*event.payload)
            else:
                handoff, version = event.payload
                if version != handoff.version:  # its transfers land later now: a later event has it
                    touched = []
                elif event.kind == PULL_DONE:
                    touched = self._pull_done(handoff, events.now)
                else:
                    touched = self._push_done(handoff, events.now)
            while touched:
                touched += self._kick(touched.pop(0), events)
        return events.now

    # -- events -----------------------------------------------------------------------------------

    def _arrive(self, request: SimRequest) -> list[str]:
        """Route it, as the scheduler does, and hand it (or its prefill part) to its engine."""
        query = self.queries.get(request.prompt_len)
        if query is None:
            query = self.queries[request.prompt_len] = RouteQuery(MODEL, request.prompt_len)
        decision, self.routing_state = self.route(query, self._cached(request, self._views(request.arrival)),
                                                  self.routing_state)
        if decision is None:
            raise RuntimeError(f"routing policy {self.routing!r} found no engine for {request.request_id}")
        for engine_id in (decision.prefill, decision.decode, decision.engine):
            if engine_id is not None:
                self._routed(engine_id, request.prompt_len)
        if decision.mode == "colocated" or request.max_tokens == 1:
            engine_id = decision.engine or decision.prefill
            if self._joined(engine_id, request):
                return []  # its engine is busy with the run until the run's end: nothing to kick
            self._settled(engine_id).add(request)
            return [engine_id]
        part = SimRequest(request.request_id, request.arrival, request.prompt_len, 1, request.ttft_slo_ms,
                          request.tbt_slo_ms, request.predicted_output_len, hold_kv=True,
                          push=decision.decode if self.transfer_mode == "push" else None,
                          block_names=request.block_names)
        handoff = Handoff(request, decision.prefill, decision.decode, part)
        if self.transfer_mode == "push":
            return self._reserve(handoff, request.arrival)
        if self._settled(decision.prefill).add(part):
            self.handoffs[request.request_id] = handoff
        return [decision.prefill]

    def _reserve(self, handoff: Handoff, now: float) -> list[str]:
        """Push: the decode part asks its engine for blocks before the prefill starts."""
        prefill = self.members[handoff.prefill].engine
        if not prefill.fits(handoff.prefill_part):
            prefill.add(handoff.prefill_part)  # refused there: it could never fit
            return []
        handoff.decode_part = _decode_part(handoff.whole, now)
        if not self._settled(handoff.decode).add(handoff.decode_part):
            return []
        self.handoffs[handoff.whole.request_id] = handoff
        return [handoff.decode]

    def _step_done(self, engine_id: str, step: Step, events: EventQueue) -> list[str]:
        now, member = events.now, self.members[engine_id]
        member.busy = False
        touched = [engine_id]
        for part in member.engine.complete(step, now):
            handoff = self.handoffs.get(part.request_id)
            if handoff is None:  # served whole: its own record
                self.ended(part, engine_id)
            elif part is not handoff.prefill_part:
                self._finish(self.handoffs.pop(part.request_id), engine_id)
            elif self.transfer_mode == "pull":
                touched += self._to_decode(handoff, now)
            else:
                handoff.transfer_start = now
                events.schedule(handoff.acked_at, PUSH_DONE, (handoff, handoff.version))
        return touched

    def _push_chunks(self, engine_id: str, step: Step, start: float, end: float) -> None:
        """Queue the writes of the prefill parts' chunks on the engine's link, each layer's when the step
        from `start` to `end` reaches its end (evenly)."""
        writes, layers = [], self.geometry.num_layers
        for part, n in step.chunks:
            handoff = self.handoffs.get(part.request_id)
            if handoff is not None and part is handoff.prefill_part:
                # The prefix cache's blocks are written with the first chunk computed after them, as the
                # native engine writes every block of the prompt (engine_handoff._pusher).
                computed = 0 if part.num_computed == part.num_cached else part.num_computed
                transfer = push(self.link, self.geometry, self.members[handoff.decode].engine.spec.block_size,
                                computed, part.num_computed + n - computed)
                releases = writes[0][3] if writes else [start + (end - start) * layer / layers
                                                        for layer in range(1, layers + 1)]
                writes.append((handoff.decode, handoff, transfer, releases))
        if writes:
            self._acked(self._link(engine_id).add(start, writes))

    def _push_done(self, handoff: Handoff, now: float) -> list[str]:
        """The last write is ACKed: the first token goes out, the prefill engine frees the KV, and the
        decode part runs on the blocks written."""
        whole = handoff.whole
        whole.token_times.append(now)
        whole.scheduled_at, whole.num_cached = handoff.prefill_part.scheduled_at, handoff.prefill_part.num_cached
        whole.transfer_s = now - handoff.transfer_start
        self.members[handoff.prefill].engine.release_held(whole.request_id)
        self._settled(handoff.decode).pulled(handoff.decode_part)
        return [handoff.prefill, handoff.decode]

    def _to_decode(self, handoff: Handoff, now: float) -> list[str]:
        """Pull: the first token is out; the decode part goes to its engine, the prompt's KV elsewhere."""
        whole, first = handoff.whole, handoff.prefill_part
        whole.token_times.append(now)
        whole.scheduled_at, whole.num_cached = first.scheduled_at, first.num_cached
        handoff.decode_part = _decode_part(whole, now)
        if self._settled(handoff.decode).add(handoff.decode_part):
            return [handoff.decode]
        # It could never fit there: the held KV goes, as when its lease runs out.
        self.members[handoff.prefill].engine.release_held(whole.request_id)
        del self.handoffs[whole.request_id]
        return [handoff.prefill]

    def _pull_done(self, handoff: Handoff, now: float) -> list[str]:
        """COMPLETE acknowledged: the decode part runs, the prefill engine frees the KV."""
        self._settled(handoff.decode).pulled(handoff.decode_part)
        self.members[handoff.prefill].engine.release_held(handoff.whole.request_id)
        handoff.whole.transfer_s = now - handoff.transfer_start
        return [handoff.prefill, handoff.decode]

    def _finish(self, handoff: Handoff, engine_id: str) -> None:
        whole, first, rest = handoff.whole, handoff.prefill_part, handoff.decode_part
        whole.token_times += rest.token_times
        whole.preemptions = first.preemptions + rest.preemptions
        whole.finished_at = rest.finished_at
        self.ended(whole, engine_id)

    def ended(self, request: SimRequest, engine_id: str) -> None:
        """A request given to `run` has its last token (at its `finished_at`), on `engine_id` (a split
        one's decode engine): a hook for a subclass, which may add requests to that engine here (bench
        sim_car's closed-loop clients send their next turn). Called as the step that ended it ends, or,
        in a decode run, when the run is applied (at a heartbeat, a cut or its end: later than the
        request's end, so a closed loop wants `max_run_steps` 0)."""

    def admitted(self, request: SimRequest) -> SimRequest | None:
        """An arrival as admission lets it in: the request to route now (itself, here), or None to hold it
        back. A hook for a subclass with a front door (sim/admission.py), which routes a held request
        later through `arrive`."""
        return request

    def arrive(self, request: SimRequest) -> None:
        """`request` arrives at its `arrival` (now or later), as one given to `run` does."""
        self.events.schedule(request.arrival, ARRIVAL, request)

    # -- engines ----------------------------------------------------------------------------------

    def _kick(self, engine_id: str, events: EventQueue) -> list[str]:
        """Step the engine if it is idle and has work. The decode parts its step gave blocks to start
        their pull, or (push) their prefill: the prefill engines to step next."""
        member, prefills = self.members[engine_id], []
        while not member.busy and member.engine.has_work():
            run = decode_run.plan(member.engine, events.now, self.max_run_steps) if self.max_run_steps else None
            if run is not None:
                member.run, member.busy = run, True
                events.schedule(run.due, RUN_DONE, (engine_id, run, run.version))
                break
            step = member.engine.schedule(events.now)
            for part in step.pulls:
                handoff = self.handoffs[part.request_id]
                if self.transfer_mode == "pull":
                    self._start_pull(handoff, events)
                else:  # the prefill engine gets the prompt now
                    handoff.prefill_part.arrival = events.now
                    self._settled(handoff.prefill).add(handoff.prefill_part)
                    prefills.append(handoff.prefill)
            if step.chunks:
                end = events.now + member.engine.seconds(step)
                if self.transfer_mode == "push" and self.handoffs:
                    self._push_chunks(engine_id, step, events.now, end)
                events.schedule(end, STEP_DONE, (engine_id, step))
                member.busy = True
            elif not step.preempted:  # nothing fits until something else happens
                break
        return prefills

    def _run_done(self, engine_id: str, run: DecodeRun, version: int) -> list[str]:
        """A decode run's event (unless it was cut since: then its new end is due): at the end of its last
        step it is applied and the engine schedules as usual; before that it is costed out past now and
        its event comes again."""
        member, now = self.members[engine_id], self.events.now
        if member.run is not run or run.version != version:
            return []
        run.in_progress(now)
        if run.more or run.end > now:
            self.events.schedule(run.due, RUN_DONE, (engine_id, run, run.version))
            return []
        steps = len(run.ends)
        self._ended(decode_run.apply(member.engine, run, steps, steps), engine_id)
        member.run, member.busy = None, False
        return [engine_id]

    def _joined(self, engine_id: str, request: SimRequest) -> bool:
        """Whether the request joined the engine's decode run (decode_run.py: the common arrival)."""
        run = self.members[engine_id].run  # its event stays: a join makes no step shorter
        return run is not None and run.join(self.members[engine_id].engine, request, self.events.now)

    def _settled(self, engine_id: str) -> SimEngine:
        """The engine, its decode run (if any) cut after the step in progress and applied through it
        (those the step ends leave at its end): what it is about to be told changes its batch from the
        next step on."""
        member = self.members[engine_id]
        run = member.run
        if run is not None:
            steps = run.in_progress(self.events.now)
            shorter = steps < run.limit
            run.cut(steps)  # it ends with the step in progress, whatever it could have gone on to
            if shorter:
                self.events.schedule(run.end, RUN_DONE, (engine_id, run, run.version))
            self._ended(decode_run.apply(member.engine, run, steps, steps - 1), engine_id)
        return member.engine

    def _ended(self, parts: list[SimRequest], engine_id: str) -> None:
        """Requests a decode run ended: a split one's record takes its decode part's tokens."""
        for part in parts:
            if part.request_id in self.handoffs:
                self._finish(self.handoffs.pop(part.request_id), engine_id)
            else:
                self.ended(part, engine_id)

    def _start_pull(self, handoff: Handoff, events: EventQueue) -> None:
        transfer = pull(self.link, self.geometry, self.members[handoff.decode].engine.spec.block_size,
                        handoff.decode_part.kv_elsewhere)
        handoff.transfer_start = events.now
        self._acked(self._link(handoff.prefill).add(events.now, [(handoff.decode, handoff, transfer, (events.now,))]))

    def _link(self, prefill: str) -> SharedLink:
        return self.links.setdefault(prefill, SharedLink())

    def _acked(self, landed: list[tuple[Handoff, float]]) -> None:
        """Hand-offs whose transfers land at a new time (queued now, or slowed by one queued now): their
        ACK moves, and its event with it once there is one (a pull's from its start, a push's from the
        prefill's end)."""
        for handoff, at in landed:
            handoff.acked_at, handoff.version = at + self.link.latency_s, handoff.version + 1
            if handoff.transfer_start is not None:
                self.events.schedule(handoff.acked_at, PULL_DONE if self.transfer_mode == "pull" else PUSH_DONE,
                                     (handoff, handoff.version))

    def _views(self, now: float) -> EngineTable:
        """Each engine as the scheduler sees it (services/scheduler/cluster.py): its load at its last
        heartbeat (free device blocks, waiting and running requests), with the routes sent to it
        since counted as waiting and their prompts' blocks as taken."""
        if self.reported_at is None or now - self.reported_at >= self.heartbeat_s:
            self._report(now)
        return self.table.snapshot()  # the policy's own: routes change the cluster's table

    def _cached(self, request: SimRequest, table: EngineTable) -> Sequence[EngineView]:
        """The views with what each engine's prefix cache holds of the prompt's leading blocks, and of
        those how many on its device, as the scheduler reads kvmeta's cache table for every route (prefix
        aware routing scores them); the table itself for a prompt of no named blocks."""
        if not request.block_names:
            return table
        views = list(table)
        for i, view in enumerate(views):
            blocks = self.members[view.id].engine.blocks
            nodes = blocks.cached_prefix(request) if isinstance(blocks, PrefixCount) and view.role != "decode" else []
            if nodes:
                views[i] = replace(view, cached_blocks=len(nodes),
                                   cached_device_blocks=sum(node.tier == "device" for node in nodes))
        return views

    @staticmethod
    def _view(engine_id: str, member: Member) -> EngineView:
        spec, report = member.engine.spec, member.report
        load = build_load(max(0, report.free_device_blocks - member.routed_blocks), report.total_device_blocks,
                          report.waiting + member.routed, report.running) if member.routed else report
        # No prefix cached (0, None); built at every route, slot by slot (view_builders.py).
        return build_view(engine_id, member.role, MODEL, load, spec.block_size, 0, None,
                          (spec.block_size, spec.num_layers))

    def _report(self, now: float) -> None:
        """The engines' heartbeats, every `heartbeat_s` from 0, all at once: each new report replaces
        an engine's last and the routes counted since it."""
        views = []
        for engine_id, member in self.members.items():
            engine, run = member.engine, member.run
            if run is None:
                free, waiting, running = engine.free, len(engine.waiting), len(engine.running)
            else:  # as if applied through the step in progress, as a cut is; it goes on
                steps = run.in_progress(self.events.now)
                ended, free, waiting, running = decode_run.report(engine, run, steps, steps - 1)
                self._ended(ended, engine_id)
            member.report = build_load(free, engine.spec.device_blocks, waiting, running)
            member.routed = member.routed_blocks = 0
            views.append(self._view(engine_id, member))
        self.table.reset(views)
        self.reported_at = now - (now % self.heartbeat_s if self.heartbeat_s > 0 else 0.0)

    def _routed(self, engine_id: str, prompt_tokens: int) -> None:
        member = self.members[engine_id]
        spec = member.engine.spec
        member.routed += 1
        member.routed_blocks += blocks_for(prompt_tokens, spec.block_size) * spec.num_layers
        self.table.update(self._view(engine_id, member))


def build(topology: Topology, spec: EngineSpec, cost: StepCost, policies: Mapping[str, str] | None = None,
          routing: str = registry.DEFAULT, link: LinkSpec = LinkSpec(), geometry: KVGeometry = KVGeometry(),
          transfer_mode: str = "pull", heartbeat_s: float = HEARTBEAT_S,
          max_run_steps: int = MAX_RUN_STEPS) -> Cluster:
    """A cluster of the topology's engines, alike: the same spec, step cost and engine policies."""
    return Cluster({engine_id: (role, SimEngine(spec, cost, policies)) for engine_id, role in topology.roles().items()},
                   routing, link, geometry, transfer_mode, heartbeat_s, max_run_steps)


def _decode_part(whole: SimRequest, arrival: float) -> SimRequest:
    """What admission sends the decode engine: the prompt and first token, the tokens left, and the
    prompt's KV elsewhere."""
    return SimRequest(whole.request_id, arrival, whole.prompt_len + 1, whole.max_tokens - 1, whole.ttft_slo_ms,
                      whole.tbt_slo_ms, None if whole.predicted_output_len is None
                      else max(1, whole.predicted_output_len - 1), kv_elsewhere=whole.prompt_len,
                      block_names=whole.block_names)
