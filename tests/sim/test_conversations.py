"""Conversations (sim/conversations.py): a shared system prompt's blocks named alike in every
conversation, turns drawn alike open or closed loop, and the closed loop sending each turn a think time
after the answer before it; routing sees what each engine's prefix cache holds of a prompt."""

import pytest

from kvmesh.sim.conversations import (ConversationLoop, Conversations, conversation_shape, conversation_turns,
                                      conversations)
from kvmesh.sim.engine import EngineSpec, SimEngine
from kvmesh.sim.request import SimRequest
from kvmesh.sim.step_cost import StepCost
from kvmesh.sim.topology import Topology
from kvmesh.sim.workload import Lengths

COST = StepCost(a=0.01, b=1e-5, c=1e-4)
SHAPE = Conversations(rate=2.0, turns=3, history=0, message=Lengths("fixed", 20), output=Lengths("fixed", 12),
                      think_s=1.0, max_context=4096, system=40)


def test_every_conversation_opens_with_the_same_system_prompt_blocks():
    requests = {r.request_id: r for r in conversations(SHAPE, 6, block_size=16, seed=0)}
    c0, c1 = requests["c0t0"], requests["c1t0"]
    assert c0.prompt_len == 40 + 20 and requests["c0t1"].prompt_len == 40 + 20 + 12 + 20
    # 40 tokens: two full blocks of the system prompt, shared; the third holds the user's message too
    assert c0.block_names[:2] == c1.block_names[:2] == ("system:0", "system:1")
    assert c0.block_names[2:] == ("c0:2", "c0:3") and c1.block_names[2] == "c1:2"
    assert requests["c0t1"].block_names[:4] == c0.block_names


def test_no_turns_and_no_system_prompt_is_the_lone_requests_workload():
    assert conversation_shape(1, 5.0, 0, 4096, Lengths("fixed", 8), Lengths("fixed", 8)) is None
    shape = conversation_shape(1, 5.0, 100, 4096, Lengths("fixed", 8), Lengths("fixed", 8))
    assert (shape.turns, shape.system, shape.history) == (1, 100, 0)
    with pytest.raises(ValueError, match="--max-context"):
        conversation_shape(2, 5.0, 4096, 4096, Lengths("fixed", 8), Lengths("fixed", 8))


class Recorded(ConversationLoop):
    """Records the engine each request ended on."""

    def ended(self, request, engine_id):
        self.served_on = {**getattr(self, "served_on", {}), request.request_id: engine_id}
        super().ended(request, engine_id)


def test_the_closed_loop_sends_each_turn_a_think_time_after_the_answer_before_it():
    talks = conversation_turns(SHAPE, 12, block_size=16, seed=3)
    drawn = [(r.request_id, r.prompt_len, r.max_tokens) for talk in talks for r, _ in talk]
    loop = Recorded.build(Topology(colocated=1), EngineSpec(), COST, {}, talks)
    loop.run()
    assert [(r.request_id, r.prompt_len, r.max_tokens) for talk in talks for r, _ in talk] == drawn
    for talk in talks:
        for (before, think), (after, _) in zip(talk, talk[1:]):
            assert after.arrival == pytest.approx(before.finished_at + think)
    assert len(loop.served_on) == 12


def test_prefix_aware_routing_sends_a_conversation_where_its_history_is_cached():
    shape = Conversations(rate=4.0, turns=4, history=0, message=Lengths("fixed", 64), output=Lengths("fixed", 16),
                          think_s=0.5, max_context=4096)
    spec = EngineSpec(prefix_caching=True)
    talks = conversation_turns(shape, 32, block_size=16, seed=1)
    loop = Recorded.build(Topology(colocated=2), spec, COST, {"cache_policy": "lru"}, talks, routing="prefix_aware",
                          heartbeat_s=0.0)
    loop.run()
    for talk in talks:
        assert len({loop.served_on[r.request_id] for r, _ in talk}) == 1, talk[0][0].request_id
    served = list(loop.served_on.values())
    assert 0 < served.count("engine-c0") < len(served)  # both engines serve
    assert sum(r.num_cached for talk in talks for r, _ in talk[1:]) > 0


def test_a_pool_of_clients_sends_the_next_turn_of_its_queue_a_think_time_after_any_of_its_answers():
    """Two clients on one queue (as bench car's system-prompt clients): two requests in flight."""
    requests = [SimRequest(f"r{i}", 0.0, 16, 2 + 2 * (i == 0)) for i in range(4)]
    engines = {"e": ("both", SimEngine(EngineSpec(block_size=16, device_blocks=64), StepCost(a=0.01)))}
    ConversationLoop(engines, [[(r, 0.5) for r in requests]], senders=[2]).run()
    r0, r1, r2, r3 = requests
    # 10 ms a step; r1, routed as it arrives, joins at the second step and ends first (2 tokens): the
    # queue's next, r2, is sent 0.5 s after it; r3 0.5 s after r0 (4 tokens).
    assert (r1.finished_at, r0.finished_at) == pytest.approx((0.03, 0.04))
    assert (r2.arrival, r3.arrival) == pytest.approx((0.53, 0.54))
    with pytest.raises(ValueError, match="one engine"):
        ConversationLoop({**engines, "f": engines["e"]}, [], in_process=True)
