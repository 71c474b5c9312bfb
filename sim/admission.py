"""A cluster behind admission's front door (sim/front_door.py): each client arrival is checked there,
waits in admission's queue or is refused, and is routed when it has a slot; a request that ends frees
its slot for the next one waiting.

What routing and the engines get is a copy of the client's request that arrives when it is let in (an
engine's arrival is when admission sends it), with the SLOs and predicted lengths admission gives it;
when it ends, the client's request takes its tokens, so its latencies run from the client's arrival and
count the wait in admission's queue. A refused request stays unfinished: a failure in every figure
(metrics.py counts it unfinished, slo_attainment as meeting nothing).

Conversations (`talks`, sim/conversations.py's closed loop): each turn is a client arrival at the door,
sent a think time after the answer before it ended; a refused turn ends its conversation, the turns
after it unsent (unfinished: failures, as the refused one).

No decode runs (`max_run_steps` 0): a run tells of its requests' first tokens and ends late, which would
free slots late and misread the backlog. A request an engine refuses (it could never fit) keeps its
slot, as nothing tells admission of it here."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from kvmesh.policies.admission import Admit

from .cluster import Cluster
from .conversations import Clients
from .engine import EngineSpec, SimEngine
from .front_door import FrontDoor
from .request import SimRequest
from .step_cost import StepCost
from .topology import Topology

# What the client's request takes from the copy that was routed, when it ends.
_RESULTS = ("token_times", "finished_at", "preemptions", "transfer_s", "scheduled_at", "num_cached", "cache_hits")


class AdmittedCluster(Cluster):
    def __init__(self, engines: Mapping[str, tuple[str, SimEngine]], door: FrontDoor,
                 talks: list[list[tuple[SimRequest, float]]] | None = None, **cluster: object):
        super().__init__(engines, **cluster, max_run_steps=0)
        self.door = door
        self.turns = Clients(talks or [])
        self.clients: dict[str, SimRequest] = {}
        self.let_in: dict[str, float] = {}        # request id -> when it was routed
        self.no_first_token: list[SimRequest] = []  # routed, no first token seen yet (the backlog's pending)

    @classmethod
    def build(cls, topology: Topology, spec: EngineSpec, cost: StepCost, policies: Mapping[str, str] | None,
              door: FrontDoor, talks: list[list[tuple[SimRequest, float]]] | None = None,
              **cluster: object) -> AdmittedCluster:
        """As cluster.build: the topology's engines, alike."""
        return cls({engine_id: (role, SimEngine(spec, cost, policies)) for engine_id, role in topology.roles().items()},
                   door, talks, **cluster)

    def run(self, requests: Iterable[SimRequest], routed: Callable[[SimRequest], None] | None = None) -> float:
        """Serve the clients' `requests` through the front door (`routed` hears of the copies routed);
        with conversations, every turn of the talks: the first ones arrive as given, the rest when sent."""
        requests = list(requests)
        self.clients = {request.request_id: request for request in requests}
        return super().run([request for request in requests if request.request_id not in self.turns.later], routed)

    def admitted(self, request: SimRequest) -> SimRequest | None:
        if request is not self.clients.get(request.request_id):
            return request  # let in earlier, arriving now
        now = self.events.now
        self._first_tokens(now)
        if self.door.arrive(request, now) is not Admit.RUN:
            return None
        return self._let_in(request, now)

    def ended(self, request: SimRequest, engine_id: str) -> None:
        client = self.clients[request.request_id]
        for name in _RESULTS:
            setattr(client, name, getattr(request, name))
        following = self.door.finished(request)
        if following is not None:
            self.arrive(self._let_in(following, self.events.now))
        following = self.turns.after(client)
        if following is not None:
            self.arrive(following[0])

    def queue_waits(self) -> list[float]:
        """Each request let in: the seconds from its arrival to its slot."""
        return [at - self.clients[request_id].arrival for request_id, at in self.let_in.items()]

    def figures(self) -> dict:
        """What the front door did: requests let in and refused (by reason), how many waited in its
        queue, and their wait for a slot (mean and P90 over the requests let in)."""
        waits = self.queue_waits()
        return {"let_in": len(waits), "refused": len(self.door.refused),
                "refused_by": dict(Counter(self.door.refused.values())), "queued": sum(w > 0 for w in waits),
                "queue_wait_mean_s": float(np.mean(waits)) if waits else None,
                "queue_wait_p90_s": float(np.percentile(waits, 90)) if waits else None}

    def _let_in(self, client: SimRequest, now: float) -> SimRequest:
        """What admission sends the cluster for `client` at `now`."""
        self.let_in[client.request_id] = now
        sent = SimRequest(client.request_id, now, client.prompt_len, client.max_tokens, client.ttft_slo_ms,
                          client.tbt_slo_ms, client.predicted_output_len, client.predicted_output_low,
                          client.predicted_output_median, block_names=client.block_names)
        self.no_first_token.append(sent)
        return sent

    def _first_tokens(self, now: float) -> None:
        """Tell the backlog of the first tokens that came since the last arrival, in time order."""
        firsts = sorted(r.token_times[0] for r in self.no_first_token if r.token_times)
        if firsts:
            self.no_first_token = [r for r in self.no_first_token if not r.token_times]
            for at in firsts:
                self.door.first_token(at)
