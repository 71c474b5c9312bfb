"""Routing policies: exact picks for hand-built views (pure functions, no I/O)."""

from __future__ import annotations

import pytest

from kvmesh.policies.routing import registry
from kvmesh.policies.routing.conditional import MAX_PREFILL_QUEUE, conditional
from kvmesh.policies.routing.least_loaded import least_loaded
from kvmesh.policies.routing.prefix_aware import prefix_aware, score
from kvmesh.policies.routing.round_robin import round_robin
from kvmesh.policies.routing.views import EngineLoad, EngineView, RouteDecision, RouteQuery, RoutingState

ALL = [round_robin, least_loaded, prefix_aware, conditional]


def engine(engine_id: str, role: str = "prefill", *, free: int = 100, total: int = 100, waiting: int = 0,
           running: int = 0, cached: int = 0, model: str = "tiny", on_device: int | None = None,
           layout: tuple = ("native", 16)) -> EngineView:
    return EngineView(id=engine_id, role=role, model=model, block_size=16, cached_blocks=cached,
                      cached_device_blocks=on_device, kv_layout=layout,
                      load=EngineLoad(free_device_blocks=free, total_device_blocks=total, waiting=waiting,
                                      running=running))


def route(policy, engines, prompt_tokens: int = 128, exclude=(), state=RoutingState(), model: str = "tiny"):
    return policy(RouteQuery(model=model, prompt_tokens=prompt_tokens, exclude=frozenset(exclude)), engines, state)


# -- round robin ----------------------------------------------------------------------------------

def test_round_robin_cycles_each_role_by_id():
    engines = [engine("p1"), engine("p0"), engine("p2"), engine("d1", "decode"), engine("d0", "decode")]
    state, picks = RoutingState(), []
    for _ in range(4):
        decision, state = route(round_robin, engines, state=state)
        picks.append((decision.prefill, decision.decode))
    assert picks == [("p0", "d0"), ("p1", "d1"), ("p2", "d0"), ("p0", "d1")]


def test_round_robin_gives_a_joining_engine_its_turn_and_skips_a_departed_one():
    decode = engine("d0", "decode")
    decision, state = route(round_robin, [engine("p0"), engine("p2"), decode])
    assert decision.prefill == "p0"
    decision, state = route(round_robin, [engine("p0"), engine("p1"), engine("p2"), decode], state=state)
    assert decision.prefill == "p1"
    decision, state = route(round_robin, [engine("p0"), decode], state=state)  # p1, p2 left
    assert decision.prefill == "p0"


def test_round_robin_is_pure_it_returns_a_new_state():
    state = RoutingState()
    _, after = route(round_robin, [engine("p0"), engine("d0", "decode")], state=state)
    assert state.cursors == {} and after.cursors == {"tiny/prefill": "p0", "tiny/decode": "d0"}


# -- least loaded ---------------------------------------------------------------------------------

def test_least_loaded_prefers_most_free_device_blocks():
    engines = [engine("p0", free=10), engine("p1", free=90, waiting=3), engine("p2", free=50),
               engine("d0", "decode", free=5), engine("d1", "decode", free=6)]
    decision, _ = route(least_loaded, engines)
    assert (decision.prefill, decision.decode) == ("p1", "d1")


def test_least_loaded_breaks_ties_by_shorter_queue_then_fewer_running():
    engines = [engine("p0", waiting=2), engine("p1", waiting=1, running=5), engine("p2", waiting=1, running=2),
               engine("d0", "decode", running=3), engine("d1", "decode", running=1)]
    decision, _ = route(least_loaded, engines)
    assert (decision.prefill, decision.decode) == ("p2", "d1")


# -- conditional disaggregation -------------------------------------------------------------------

def test_conditional_pairs_engines_while_the_prefill_queue_is_short():
    engines = [engine("p0", waiting=MAX_PREFILL_QUEUE - 1), engine("d0", "decode")]
    decision, _ = route(conditional, engines)
    assert (decision.mode, decision.prefill, decision.decode) == ("disaggregated", "p0", "d0")


def test_conditional_prefills_on_the_decode_engine_while_the_prefill_engine_is_backed_up():
    engines = [engine("p0", waiting=MAX_PREFILL_QUEUE), engine("d0", "decode", cached=3, running=12)]
    decision, _ = route(conditional, engines)
    assert (decision.mode, decision.engine, decision.cached_blocks) == ("colocated", "d0", 3)


def test_conditional_keeps_the_pair_when_the_decode_engine_has_a_queue_too():
    engines = [engine("p0", waiting=5), engine("d0", "decode", waiting=1)]
    decision, _ = route(conditional, engines)
    assert (decision.mode, decision.prefill, decision.decode) == ("disaggregated", "p0", "d0")


def test_conditional_takes_the_least_loaded_decode_engine_as_least_loaded_pairs_it():
    engines = [engine("p0", waiting=4), engine("d0", "decode", free=10), engine("d1", "decode", free=80)]
    decision, _ = route(conditional, engines)
    assert (decision.mode, decision.engine) == ("colocated", "d1")


# -- prefix aware ---------------------------------------------------------------------------------

def test_prefix_aware_prefers_the_engine_holding_the_longest_prefix():
    engines = [engine("p0", cached=2), engine("p1", cached=6, free=70, waiting=1), engine("p2"),
               engine("d0", "decode", free=40), engine("d1", "decode", free=60)]
    decision, _ = route(prefix_aware, engines, prompt_tokens=128)
    # p1: 96 - 0.5*1*128 - 0.3*128 = -6.4; p0: 32; p2: 0
    assert (decision.prefill, decision.decode, decision.cached_blocks) == ("p0", "d1", 2)
    engines[1] = engine("p1", cached=6, free=90)
    decision, _ = route(prefix_aware, engines, prompt_tokens=128)
    assert (decision.prefill, decision.cached_blocks) == ("p1", 6)


def test_prefix_aware_weighs_blocks_in_the_cxl_tier_a_reload_below_those_on_the_device():
    # 8 blocks of 16 tokens: all on the device, 128; 2 on the device and 6 in cxl, 32 + 0.95 * 96 = 123.2
    device, cxl = engine("p0", cached=8, on_device=8), engine("p1", cached=8, on_device=2)
    more = engine("p2", cached=9, on_device=0)
    assert score(device, 128) == pytest.approx(128) and score(cxl, 128) == pytest.approx(123.2)
    decision, _ = route(prefix_aware, [cxl, device, engine("d0", "decode")], prompt_tokens=128)
    assert decision.prefill == "p0"
    decision, _ = route(prefix_aware, [device, more, engine("d0", "decode")], prompt_tokens=160)
    assert decision.prefill == "p2"   # 0.95 * 144 = 136.8 > 128: a longer prefix a reload away still wins


def test_prefix_aware_leaves_the_prefix_when_its_holder_is_much_busier():
    holder, idle = engine("p0", cached=8, waiting=3), engine("p1")
    decision, _ = route(prefix_aware, [holder, idle, engine("d0", "decode")], prompt_tokens=128)
    assert decision.prefill == "p1"  # 128 - 0.5*3*128 = -64 < 0
    decision, _ = route(prefix_aware, [engine("p0", cached=8, waiting=1), idle, engine("d0", "decode")],
                        prompt_tokens=128)
    assert decision.prefill == "p0"  # 128 - 64 = 64 > 0


def test_prefix_aware_without_cache_hits_falls_back_to_load():
    decision, _ = route(prefix_aware, [engine("p0", free=20), engine("p1", free=80), engine("d0", "decode")])
    assert decision.prefill == "p1"


# -- what every policy shares ---------------------------------------------------------------------

@pytest.mark.parametrize("policy", ALL, ids=lambda p: p.__name__)
def test_excluded_engines_are_never_picked(policy):
    engines = [engine("p0", cached=8), engine("p1", free=10), engine("d0", "decode"), engine("d1", "decode", free=1)]
    decision, _ = route(policy, engines, exclude={"p0", "d0"})
    assert (decision.prefill, decision.decode) == ("p1", "d1")


@pytest.mark.parametrize("policy", ALL, ids=lambda p: p.__name__)
def test_colocated_engine_only_when_there_is_no_pair_for_the_model(policy):
    both = engine("b0", "both", cached=3)
    decision, _ = route(policy, [engine("p0"), both, engine("d0", "decode", model="other")])
    assert decision == RouteDecision(engine="b0", cached_blocks=3) and decision.mode == "colocated"
    decision, _ = route(policy, [engine("p0"), both, engine("d0", "decode")])
    assert decision.mode == "disaggregated" and (decision.prefill, decision.decode) == ("p0", "d0")
    decision, _ = route(policy, [engine("p0"), both, engine("d0", "decode")], exclude={"d0"})
    assert decision.engine == "b0"


@pytest.mark.parametrize("policy", ALL, ids=lambda p: p.__name__)
def test_kv_goes_only_between_engines_of_one_layout(policy):
    vllm = ("vllm", 32)
    engines = [engine("p0", cached=8, free=1000), engine("p1", layout=vllm), engine("d0", "decode", free=1000),
               engine("d1", "decode", layout=vllm, free=1), engine("d2", "decode", layout=vllm)]
    decision, _ = route(policy, engines, exclude={"d0"})   # p0's only partner is gone: p1 with a vLLM decode engine
    assert decision.prefill == "p1" and decision.decode in {"d1", "d2"}
    decision, _ = route(policy, engines, exclude={"p1"})   # p0 pairs with d0, never with a vLLM engine
    assert (decision.prefill, decision.decode) == ("p0", "d0")
    both = engine("b0", "both")
    decision, _ = route(policy, [engine("p0"), engine("d1", "decode", layout=vllm), both])
    assert decision.engine == "b0"   # no pair of one layout: colocated


@pytest.mark.parametrize("policy", ALL, ids=lambda p: p.__name__)
def test_a_pair_that_lost_one_side_serves_on_the_side_left_colocated(policy):
    """No pair and no `both` engine: the prefill engines whose decode engines are all down (or the
    decode engines whose prefill engines are) serve the request themselves, rather than none."""
    decision, _ = route(policy, [engine("p0", cached=2), engine("d0", "decode")], exclude={"d0"})
    assert decision == RouteDecision(engine="p0", cached_blocks=2) and decision.mode == "colocated"
    decision, _ = route(policy, [engine("d1", "decode", free=50), engine("d0", "decode")])
    assert decision == RouteDecision(engine="d0")
    decision, _ = route(policy, [engine("p0"), engine("b0", "both"), engine("d0", "decode")], exclude={"d0"})
    assert decision.engine == "b0"  # a `both` engine first


@pytest.mark.parametrize("policy", ALL, ids=lambda p: p.__name__)
def test_no_engine_for_the_model_is_no_decision(policy):
    engines = [engine("p0", model="other"), engine("d0", "decode", model="other"), engine("b0", "both")]
    assert route(policy, engines, model="tiny", exclude={"b0"})[0] is None
    assert route(policy, [], model="tiny")[0] is None


def test_registry_finds_every_policy_by_name():
    assert registry.names()[:3] == ["round_robin", "least_loaded", "prefix_aware"]
    assert registry.resolve("prefix_aware") is prefix_aware and registry.DEFAULT == "conditional"
    with pytest.raises(KeyError, match="no routing policy named 'fastest'"):
        registry.resolve("fastest")
