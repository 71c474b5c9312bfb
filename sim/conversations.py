"""Multi-turn conversations, the workload of KV reuse (CaR): each conversation opens with a context of
`history` tokens (earlier chat, a document), after a shared system prompt of `system` tokens, the same
in every conversation; each later turn's prompt is the conversation so far (every earlier prompt and
answer) and a new user message. A conversation with no history opens with a message, as its later
turns do. A request names its full blocks by content (SimRequest.block_names): the system prompt's
blocks alike in every conversation, the rest by conversation and block index, so turn k+1's names
extend turn k's as its tokens do, and the prefix cache (prefix_count.py) finds them.

Conversations start as a Poisson process; a conversation ends at `turns` turns or at the context
window, whichever comes first. Two ways to send the later turns:
- open loop (`conversations`): a turn arrives a think time (exponential) after the one before it
  arrived, whether or not that one has finished (the arrivals are fixed before the run), so a turn
  that comes early finds only what was cached by then;
- closed loop (`ConversationLoop`): a turn is sent a think time after the answer before it ended, as a
  user reads and types; a turn whose answer never comes leaves the rest of its conversation unsent.
The lengths and think times are drawn alike either way (the same seed, the same draws)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .cluster import Cluster
from .engine import EngineSpec, SimEngine
from .request import SimRequest
from .step_cost import StepCost
from .topology import Topology
from .workload import Lengths


@dataclass(frozen=True, slots=True)
class Conversations:
    rate: float              # conversations started per second
    turns: int               # turns of each conversation, at most
    history: int             # tokens its first turn's prompt opens with, after the system prompt (0: a message)
    message: Lengths         # a later turn's new tokens
    output: Lengths          # every turn's answer
    think_s: float           # mean time from one turn's arrival (open loop) or answer (closed) to the next turn
    max_context: int         # prompt and answer together at most (the model's context window)
    system: int = 0          # tokens of a system prompt every conversation opens with, the same in all


def conversation_turns(shape: Conversations, n: int, block_size: int,
                       seed: int) -> list[list[tuple[SimRequest, float]]]:
    """`n` requests (the last conversation may be cut short), by conversation: each turn and the think
    time drawn after it; request `c{i}t{k}` is conversation i's turn k. A first turn's arrival is its
    conversation's start, a later one's the previous turn's arrival plus its think time (open loop)."""
    if shape.rate <= 0 or shape.turns < 1 or n < 1 or shape.system + shape.history + 1 >= shape.max_context:
        raise ValueError(f"conversations need rate > 0, turns >= 1, n >= 1 and a system prompt and history below "
                         f"the context window; got {shape.rate}, {shape.turns}, {n}, "
                         f"{shape.system} + {shape.history} of {shape.max_context}")
    rng = np.random.default_rng(seed)
    shared = tuple(f"system:{j}" for j in range(shape.system // block_size))
    talks: list[list[tuple[SimRequest, float]]] = []
    count, start = 0, 0.0
    for i in range(n):
        start += rng.exponential(1 / shape.rate)
        arrival, context, talk = start, 0, []
        for k in range(shape.turns):
            if k == 0:
                prompt = shape.system + (shape.history or shape.message.draw(rng, 1)[0])
            else:
                prompt = context + shape.message.draw(rng, 1)[0]
            output = min(shape.output.draw(rng, 1)[0], shape.max_context - prompt)
            if output < 1 or count == n:
                break
            names = shared + tuple(f"c{i}:{j}" for j in range(len(shared), (prompt + output) // block_size))
            request = SimRequest(f"c{i}t{k}", arrival, prompt, output, block_names=names)
            think = rng.exponential(shape.think_s)
            talk.append((request, think))
            count, context, arrival = count + 1, prompt + output, arrival + think
        talks.append(talk)
        if count == n:
            break
    return talks


def conversations(shape: Conversations, n: int, block_size: int, seed: int) -> list[SimRequest]:
    """Open loop: `n` requests, in arrival order."""
    talks = conversation_turns(shape, n, block_size, seed)
    return sorted((request for talk in talks for request, _ in talk), key=lambda r: r.arrival)


def turn(request: SimRequest) -> int:
    """The turn a conversation's request is (0: its first, with no history of its own cached)."""
    return int(request.request_id.rpartition("t")[2])


class ConversationLoop(Cluster):
    """A cluster whose clients are conversations, closed-loop: a conversation's first turn arrives at
    its start; each later one is sent its think time after the answer before it ended (its arrival set
    then, and given to the cluster's `arrive`), and routed as any arrival. `senders`: how many clients
    send each talk's turns, in its order (1 each: a conversation; more: a pool taking turns from one
    queue, as bench car's system-prompt clients). `in_process`: the clients call one engine in process,
    as bench car's loop does: the first turns all join it before its first step, and a turn sent with
    no think time joins it before the step after the answer. No decode runs: a run applies its
    requests' ends late, so a turn would be sent late."""

    def __init__(self, engines: Mapping[str, tuple[str, SimEngine]], talks: list[list[tuple[SimRequest, float]]],
                 senders: Sequence[int] | None = None, in_process: bool = False, **cluster: object):
        super().__init__(engines, **cluster, max_run_steps=0)
        if in_process and len(engines) != 1:
            raise ValueError(f"in-process clients call one engine, not {len(engines)}")
        self.in_process = in_process
        self.clients = Clients(talks, senders)

    @classmethod
    def build(cls, topology: Topology, spec: EngineSpec, cost: StepCost, policies: Mapping[str, str],
              talks: list[list[tuple[SimRequest, float]]], **cluster: object) -> ConversationLoop:
        """As cluster.build: the topology's engines, alike."""
        return cls({engine_id: (role, SimEngine(spec, cost, policies)) for engine_id, role in topology.roles().items()},
                   talks, **cluster)

    def run(self, requests: object = None, routed: object = None) -> float:
        """Serve every conversation (the talks given); the simulated time when the last event happened."""
        first = self.clients.first
        if not self.in_process:
            return super().run(first)
        together = first[1:]

        def join_the_first(request: SimRequest) -> None:
            (member,) = self.members.values()
            for sent in together:
                member.engine.add(sent)
            together.clear()

        return super().run(first[:1], join_the_first)

    def ended(self, request: SimRequest, engine_id: str) -> None:
        following = self.clients.after(request)
        if following is None:
            return
        sent, think = following
        if self.in_process and think == 0:
            self.members[engine_id].engine.add(sent)
        else:
            self.arrive(sent)


class Clients:
    """Closed-loop clients over talks: each talk's turns are sent in order by `senders` clients (1 a
    talk by default: a conversation; more: a pool taking turns from one queue), each client's next
    turn its think time after the answer to its last one ended. `first`: the turns sent at the start
    (each client's first), `later`: the ids of the rest."""

    def __init__(self, talks: list[list[tuple[SimRequest, float]]], senders: Sequence[int] | None = None):
        # A turn sent -> the queue its client sends the next from, and the think time after its answer.
        self._client_of: dict[str, tuple[deque[tuple[SimRequest, float]], float]] = {}
        self.first: list[SimRequest] = []
        for talk, count in zip(talks, senders or [1] * len(talks)):
            queue = deque(talk)
            self.first += [self._send(queue) for _ in range(min(count, len(talk)))]
        sent = {request.request_id for request in self.first}
        self.later = {request.request_id for talk in talks for request, _ in talk} - sent

    def after(self, ended: SimRequest) -> tuple[SimRequest, float] | None:
        """The turn `ended`'s client sends after its answer (its arrival set: the answer's end plus the
        think time), and that think time; None when its client has nothing left to send."""
        queue, think = self._client_of.pop(ended.request_id, (None, 0.0))
        if not queue:
            return None
        sent = self._send(queue)
        sent.arrival = ended.finished_at + think
        return sent, think

    def _send(self, queue: deque[tuple[SimRequest, float]]) -> SimRequest:
        """The next turn of the queue, its client's now."""
        request, think = queue.popleft()
        self._client_of[request.request_id] = queue, think
        return request


def conversation_shape(turns: int, think_s: float, system: int, max_context: int, message: Lengths,
                       output: Lengths) -> Conversations | None:
    """The conversations `sim run` and `plan` are asked for (`--turns`, `--think-s`, `--system-prompt`,
    `--max-context`; the rate is set per run), or None for lone requests: one turn and no system prompt,
    no block shared, today's workload."""
    if turns < 1 or think_s < 0 or system < 0:
        raise ValueError(f"--turns must be at least 1, --think-s and --system-prompt at least 0; got {turns}, "
                         f"{think_s} and {system}")
    if turns == 1 and system == 0:
        return None
    if system + 1 >= max_context:
        raise ValueError(f"--system-prompt {system} leaves no room in --max-context {max_context}")
    return Conversations(1.0, turns, 0, message, output, think_s, max_context, system)
