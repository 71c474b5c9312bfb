"""CacheOpt 3.3's allocation as pure functions, with worked numbers: the embedding condition and s_0,
the host choice, D_kvc, the cut weights and amortised cuts, and the batch plans built from them."""

from __future__ import annotations

import msgspec
import pytest

from kvmesh.policies.allocation import (AllocationInput, AllocationParams, Grant, block_at_a_time, cacheopt,
                                        cacheopt_guarded, estimate, s3)
from kvmesh.policies.allocation.cacheopt import (amortised_cut, choose_host, critical_demand, cut_weights,
                                                 embedding_start, spread_hosts)
from kvmesh.policies.allocation.plan import critical_time, demand
from kvmesh.policies.views import RequestView

PARAMS = AllocationParams()  # B = 8 tokens, b = 8, m = 2, 8 reserved blocks


def req(request_id: str, prompt: int = 40, generated: int = 0, computed: int | None = None, *,
        estimate_len: int | None = 30, max_tokens: int = 1000, allocation: int | None = None, arrival: float = 0.0,
        ttft_slo_ms: float | None = None, tbt_slo_ms: float | None = None, last_token_at: float | None = None,
        tier: str = "device") -> RequestView:
    tokens = prompt + generated
    return RequestView(request_id=request_id, arrival=arrival, prompt_len=prompt, num_tokens=tokens,
                       num_computed=tokens - 1 if computed is None and generated else (computed or 0),
                       num_generated=generated, max_tokens=max_tokens, blocks_per_layer=0, tier=tier,
                       tbt_slo_ms=tbt_slo_ms, predicted_output_len=estimate_len, ttft_slo_ms=ttft_slo_ms,
                       allocation=allocation, last_token_at=last_token_at)


def batch(waiting=(), running=(), unallocated: int = 10_000, budget: int = 512, t_max: float = 0.02,
          now: float = 0.0, params: AllocationParams = PARAMS) -> AllocationInput:
    return AllocationInput(waiting=list(waiting), running=list(running), unallocated=unallocated,
                           token_budget=budget, max_iteration_s=t_max, now=now, params=params)


# -- equations ------------------------------------------------------------------------------------

def test_embedding_condition_and_start():
    # a_j - (u_j + s_o) - (s_p + s_o) = 200 - 80 - 70 = 50 >= b: s_0 = 200 - 80 - b
    assert embedding_start(200, 50, 40, 30, buffer=8) == 112
    assert embedding_start(200, 50, 40, 30, buffer=50) == 70   # exactly b to spare still fits
    assert embedding_start(200, 50, 40, 30, buffer=51) is None
    assert embedding_start(100, 90, 40, 30, buffer=0) is None  # the host would run into the guest


def test_the_host_is_the_one_with_least_unused_allocation_that_fits():
    guest = req("g", prompt=40, estimate_len=30)
    hosts = {"h1": (200, 50), "h2": (150, 20), "h3": (100, 90)}  # unused 150, 130 (fits), 10 (does not fit)
    assert choose_host(guest, hosts, PARAMS) == "h2"
    assert choose_host(guest, {"h3": (100, 90)}, PARAMS) is None


def test_critical_demand():
    # D_kvc = (100 + 8) + (50 + 8) + 3 * 8
    assert critical_demand([req("a", 100), req("b", 50)], [req(f"r{i}") for i in range(3)], PARAMS) == 190


def test_cut_weights():
    assert cut_weights([1.0, 3.0], [30, 10]) == pytest.approx([0.1875, 0.1875])
    assert cut_weights([1.0, 2.0, 1.0], [10, 10, 20]) == pytest.approx([0.0625, 0.125, 0.125])


def test_amortised_cut_shares_the_excess_by_weight():
    weights = [0.0625, 0.125, 0.125]
    # E_kvc = 300 - 240 = 60, cut 12, 24, 24.
    assert amortised_cut([100, 100, 100], [0, 0, 0], weights, 240) == [88, 76, 76]
    # The second may not go below 90: it gives 10, the other 50 is cut 1:2 from the first and third.
    assert amortised_cut([100, 100, 100], [0, 90, 0], weights, 240) == [83, 90, 66]
    assert amortised_cut([100, 50], [0, 0], [0.5, 0.5], 500) == [100, 50]  # enough for everyone: no cut
    with pytest.raises(ValueError, match="floors"):
        amortised_cut([100, 100], [90, 90], [0.5, 0.5], 150)


def test_remaining_time_and_demand():
    waiting = req("w", arrival=1.0, ttft_slo_ms=500.0)
    assert critical_time(waiting, now=1.2, params=PARAMS) == pytest.approx(0.3)
    running = req("r", generated=3, ttft_slo_ms=500.0, tbt_slo_ms=100.0, last_token_at=2.0)
    assert critical_time(running, now=2.05, params=PARAMS) == pytest.approx(0.05)
    assert critical_time(req("x"), now=5.0, params=PARAMS) == PARAMS.no_slo_rt_s
    assert demand(req("d", prompt=40, estimate_len=30), PARAMS) == 70
    assert demand(req("d", prompt=40, estimate_len=5000, max_tokens=100), PARAMS) == 140  # capped by max_tokens
    assert demand(req("d", prompt=40, generated=40, estimate_len=30), PARAMS) == 88  # outran: B past what it has


# -- plans ----------------------------------------------------------------------------------------

def test_block_offers_everyone_without_allocation():
    plan = block_at_a_time(batch([req("a"), req("b")]))
    assert plan.grants == (Grant("a", None), Grant("b", None))


def test_estimate_admits_in_order_while_the_whole_estimate_fits():
    plan = estimate(batch([req("a"), req("b", prompt=100), req("c")], unallocated=200))
    assert plan.grants == (Grant("a", 70), Grant("b", 130))  # c would fit, but FCFS stops at the first that does not


def test_estimate_and_s3_preempt_a_request_that_ran_out_and_allot_it_more_next_time():
    running = req("r", prompt=40, generated=31, allocation=70, estimate_len=30, max_tokens=200)
    assert estimate(batch(running=[running])).preempt == ("r",)
    assert s3(batch(running=[running])).preempt == ("r",)
    again = msgspec.structs.replace(req("r", prompt=40, generated=31, computed=0, estimate_len=30, max_tokens=200),
                                preemptions=2)
    assert estimate(batch([again])).grants == (Grant("r", 40 + 3 * 30),)   # the estimate once more each time
    assert s3(batch([again])).grants == (Grant("r", 40 + 4 * 30),)         # the output allotment doubled
    assert s3(batch([msgspec.structs.replace(again, preemptions=5)])).grants == (Grant("r", 40 + 200),)  # max_tokens


def test_cacheopt_gives_everyone_their_demand_when_it_fits():
    plan = cacheopt(batch([req("a", ttft_slo_ms=1000.0), req("b", ttft_slo_ms=500.0)], unallocated=1000))
    assert plan.grants == (Grant("b", 70), Grant("a", 70))  # least remaining time first
    assert plan.preempt_tokens == 0 and plan.critical == frozenset()


def test_cacheopt_critical_requests_get_their_basic_need_even_by_preemption():
    # RT_tft = 0.02 s against T_I^max = 0.02 s: critical; D_kvc = 100 + 8; 60 unallocated.
    urgent = req("u", prompt=100, ttft_slo_ms=20.0, estimate_len=50)
    plan = cacheopt(batch([urgent, req("n", ttft_slo_ms=5000.0)], unallocated=60))
    assert plan.preempt_tokens == 48 and plan.critical == {"u"}
    assert plan.grants[0] == Grant("u", 108)  # its basic requirement, nothing left for anyone else


def test_the_guarded_cacheopt_never_preempts_for_a_critical_request_one_whose_deadline_is_as_close():
    # u is critical (RT 20 ms, T_I^max 20 ms); the victims are r (next token due in 30 ms, under
    # 2 x T_I^max: it would miss it once preempted) and loose (due in 500 ms).
    urgent = req("u", prompt=100, ttft_slo_ms=20.0, estimate_len=50)
    running = [req("r", generated=5, allocation=53, tbt_slo_ms=30.0, last_token_at=0.0),
               req("loose", generated=5, allocation=53, tbt_slo_ms=500.0, last_token_at=0.0)]
    step = batch([urgent], running=running, unallocated=60)
    guarded, printed = cacheopt_guarded(step), cacheopt(step)
    assert guarded.preempt_tokens == printed.preempt_tokens == 48
    assert guarded.critical == {"u", "r"} and printed.critical == {"u"}


def test_cacheopt_trims_unused_allocations_before_preempting_for_critical_requests():
    urgent = req("u", prompt=100, ttft_slo_ms=20.0, estimate_len=50)
    roomy = req("r", prompt=40, generated=10, allocation=200, estimate_len=160)   # 150 allotted, unused
    tight = req("t", prompt=40, generated=10, allocation=60, estimate_len=20)     # 10 unused
    plan = cacheopt(batch([urgent], running=[roomy, tight], unallocated=60))
    # D_kvc 108 - 60 = 48 short: r gives 48 of its 200 - (50 + B) = 142 spare; nobody is preempted.
    assert plan.preempt_tokens == 0
    assert Grant("r", 152) in plan.grants and Grant("u", 108) in plan.grants
    assert not any(g.request_id == "t" for g in plan.grants)


def test_cacheopt_embeds_a_short_request_in_a_long_ones_unused_allocation():
    host = req("h", prompt=100, generated=10, allocation=600, estimate_len=500)
    guest = req("g", prompt=40, estimate_len=30)
    plan = cacheopt(batch([guest], running=[host], unallocated=0))
    assert plan.grants == (Grant("g", 70, hosts=(("h", 70),)),)


def test_spread_embedding_takes_what_several_hosts_will_not_reach_in_time():
    guest = req("g", prompt=40, estimate_len=30)                       # needs 70 tokens for 30 steps
    hosts = {"a": (150, 60), "b": (140, 60), "c": (80, 60)}            # offer 150-90-8 = 52, 42, 0
    assert choose_host(guest, hosts, PARAMS) is None
    assert spread_hosts(guest, hosts, PARAMS) == [("a", 52), ("b", 18)]
    assert spread_hosts(guest, {"a": (150, 60)}, PARAMS) is None
    running = [req("a", prompt=50, generated=10, allocation=150, estimate_len=100),
               req("b", prompt=50, generated=10, allocation=140, estimate_len=90)]
    assert cacheopt(batch([guest], running=running, unallocated=0)).grants == \
        (Grant("g", 70, hosts=(("a", 53), ("b", 17))),)  # they have computed 59: offers 53 and 43


def test_cacheopt_cuts_by_weight_and_lends_from_a_request_about_to_end():
    # Two waiting requests demand 200 + 100 and 100 + 100; 450 unallocated: E_kvc = 50.
    a = req("a", prompt=200, estimate_len=100, ttft_slo_ms=3000.0)
    b = req("b", prompt=100, estimate_len=100, ttft_slo_ms=1000.0)
    ending = req("e", prompt=50, generated=49, allocation=100, estimate_len=50)  # 1 token to go
    plan = cacheopt(batch([a, b], running=[ending], unallocated=450))
    # w = (3/4 * 2/3, 1/4 * 1/3) = (0.5, 1/12): cuts 50 * 6/7 and 50 * 1/7.
    grants = {g.request_id: g for g in plan.grants}
    assert grants["a"].tokens == 300 - 43 and grants["b"].tokens == 200 - 8
    # e ends (1 token to go) before either runs out; it lends once, to the one with less time.
    assert (grants["b"].lender, grants["b"].lent) == ("e", 8)
    assert grants["a"].lender is None


def test_cacheopt_tops_up_an_unfulfilled_request_about_to_end():
    nearly = req("p", prompt=40, generated=29, allocation=69, estimate_len=30)  # demand 70, 1 token to go
    far = req("f", prompt=40, generated=5, allocation=60, estimate_len=30)       # demand 70, 25 to go
    plan = cacheopt(batch(running=[nearly, far], unallocated=100))
    assert plan.grants == (Grant("p", 70),)
    assert cacheopt(batch(running=[nearly, far], unallocated=100,
                          params=AllocationParams(proactive_iterations=0))).grants == ()


def test_params_are_checked():
    with pytest.raises(ValueError):
        AllocationParams(block_tokens=0)
    with pytest.raises(ValueError):
        AllocationParams(no_slo_rt_s=0)
