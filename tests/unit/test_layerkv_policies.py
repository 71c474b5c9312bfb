"""LayerKV's equations as pure functions, with the worked numbers in the comments: Eq. 1-3 and
Algorithm 1 (SLO-aware prefill admission), Eq. 4 (retained layers), the interleaving of 3.1.2 and
the Eq. 5 forecast with its x/2-then-all offloading."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.policies.costs import OffloadCost, PrefillCost
from kvmesh.policies.offload import (OffloadInput, OffloadParams, forecast_free_blocks, interleaved,
                                     layerkv, none, offload_time_s, retained_layers)
from kvmesh.policies.prefill_admission import allowed_prefill_s, future_tokens, max_prefills, prefill_time_s
from kvmesh.policies.prefill_admission import layerkv as admit
from kvmesh.policies.views import PoolView, RequestView

PREFILL = PrefillCost(alpha=2.0, num_params=10**6, hidden_size=256, flops_per_s=1e9)
OFFLOAD = OffloadCost(beta=1.0, num_layers=4, head_dim=64, num_kv_heads=2, bytes_per_element=4,
                      bandwidth_bytes_per_s=1e9)


def staged(threshold: int) -> OffloadParams:
    """Decodes that load their offloaded layers every step (tests/policies/test_layerkv_restore.py: once)."""
    return OffloadParams(threshold_blocks=threshold, horizon_stages=3, decode_offloaded="stage")


def view(request_id: str, **fields) -> RequestView:
    defaults = dict(arrival=0.0, prompt_len=100, num_tokens=100, num_computed=0, num_generated=0, max_tokens=100,
                    blocks_per_layer=0, tier="device")
    return RequestView(request_id=request_id, **{**defaults, **fields})


def pool(free: int = 100, prefill: PrefillCost | None = PREFILL, offload: OffloadCost | None = OFFLOAD) -> PoolView:
    return PoolView(block_size=16, num_layers=4, free=MappingProxyType({"device": free, "cxl": 1000}),
                    total=MappingProxyType({"device": 100, "cxl": 1000}), prefill_cost=prefill, offload_cost=offload)


# -- Eq. 1-3, Algorithm 1 ------------------------------------------------------------------------

def test_eq1_allowance():
    # T_tpot 0.2 s over 10 past and 20 future tokens, 1.5 s spent and 20 x 0.05 = 1.0 s to come:
    # 0.2 * 30 - (1.5 + 1.0) = 3.5 s
    assert allowed_prefill_s(0.2, 10, 20, 1.5, 1.0) == pytest.approx(3.5)


def test_eq3_prefill_time():
    # 2 * 100 * (2e6 + 2 * 100 * 256) / 1e9 = 2 * 100 * 2_051_200 / 1e9 = 0.41024 s
    assert prefill_time_s(100, PREFILL) == pytest.approx(0.41024)


def test_future_tokens_are_the_lower_bound_left_and_at_least_one():
    assert future_tokens(10, 25) == 15
    assert future_tokens(30, 25) == 1      # past the lower bound: still one to come
    assert future_tokens(5, None) == 1     # no prediction: the most conservative


def test_algorithm_1_counts_leading_prefills_strictly_under_the_allowance():
    assert max_prefills([1.0, 1.0, 1.0], 2.5) == 2
    assert max_prefills([1.0, 1.0], 2.0) == 1   # Eq. 2 is strict
    assert max_prefills([3.0, 0.1], 2.0) == 0   # FCFS: no skipping ahead
    assert max_prefills([], 1.0) == 0


def decoding(tbt_slo_ms: float | None, gap: float = 0.1, **fields) -> RequestView:
    # first token at t = 10, the last at t = 12: 11 generated is 10 past the first in 2 s (0.2 s on
    # average), the latest of them `gap` after the one before
    return view("d", first_token_at=10.0, last_token_at=12.0, last_token_gap_s=gap, num_generated=11,
                num_tokens=111, num_computed=110, tbt_slo_ms=tbt_slo_ms, predicted_output_low=30, **fields)


def test_admission_admits_what_the_tightest_tpot_budget_allows_in_fcfs_order():
    waiting = [view("w2", arrival=2.0), view("w1", arrival=1.0), view("w3", arrival=3.0)]
    # N_future = 30 - 10 = 20 at the current TPOT of 0.1 s: T_future = 2 s; with a 150 ms SLO:
    # 0.15 * 30 - (2 + 2) = 0.5 s, and one 100-token prefill takes 0.41 s, two 0.82 s
    assert admit(waiting, [decoding(150.0)], pool(), now=12.0) == ["w1"]
    # 180 ms: 5.4 - 4 = 1.4 s > 1.23 s: all three
    assert admit(waiting, [decoding(180.0)], pool(), now=12.0) == ["w1", "w2", "w3"]
    # the tightest of two decides
    assert admit(waiting, [decoding(180.0), decoding(150.0)], pool(), now=12.0) == ["w1"]


def test_the_current_tpot_spreads_a_past_stall_over_the_tokens_to_come():
    waiting = [view("w1", arrival=1.0)]
    # behind its SLO on average (0.2 s > 0.15 s), but decoding at 0.1 s now: 0.5 s, one prefill
    # (the average as T_future's rate would give 0.15 * 30 - (2 + 4) < 0: none)
    assert admit(waiting, [decoding(150.0)], pool(), now=12.0) == ["w1"]
    # under its SLO on average (0.2 s < 0.25 s), but decoding at 0.3 s now: 7.5 - (2 + 6) < 0, none
    assert admit(waiting, [decoding(250.0, gap=0.3)], pool(), now=12.0) == []
    # waiting for its next token longer than its latest took: that wait is the current TPOT,
    # 0.15 * 30 - (2.5 + 0.5 * 20) < 0
    assert admit(waiting, [decoding(150.0)], pool(), now=12.5) == []


def test_admission_without_a_tpot_slo_a_decoding_request_or_a_profile_is_fcfs():
    waiting = [view("w2", arrival=2.0), view("w1", arrival=1.0)]
    prefilling = view("p", num_generated=0, tbt_slo_ms=1.0)  # no first token yet: not decoding
    for running, cost in (([decoding(None)], PREFILL), ([prefilling], PREFILL), ([decoding(220.0)], None), ([], PREFILL)):
        assert admit(waiting, running, pool(prefill=cost), now=12.0) == ["w1", "w2"]


def test_before_its_second_token_a_request_decodes_at_the_rate_the_others_do():
    # N_past 0, N_future 30: its TPOT is taken to be the running requests' median latest token time,
    # 50 ms (a peer with no TPOT SLO of its own still says how fast decodes go):
    # T_allow = 0.2 * 30 - (0.5 + 0.05 * 30) = 4 s, room for the 0.41 s prefill
    fresh = view("f", first_token_at=12.0, num_generated=1, tbt_slo_ms=200.0, predicted_output_low=30)
    peers = [decoding(None, gap=0.03), decoding(None, gap=0.05), decoding(None, gap=0.4)]
    assert admit([view("w")], [fresh, *peers], pool(), now=12.5) == ["w"]
    # alone, the SLO: 6 - (0.5 + 6) < 0, nothing
    assert admit([view("w")], [fresh], pool(), now=12.5) == []
    # waiting 5 s for its layers to come back, that wait is in T_past: 6 - (5 + 1.5) < 0, nothing
    assert admit([view("w")], [fresh, *peers], pool(), now=17.0) == []


# -- Eq. 4 and interleaving ------------------------------------------------------------------------

def test_eq4_offload_time():
    # 1000 tokens x 2 layers x 2 (K, V) x 64 x 2 heads x 4 bytes = 2_048_000 B at 1 GB/s = 2.048 ms
    assert offload_time_s(1000, 2, OFFLOAD) == pytest.approx(2.048e-3)


def test_retained_layers_are_the_fewest_whose_offload_hides_under_the_prefill():
    # all 4 offloaded: 4.096 ms > 3 ms; 3: 3.072 ms > 3 ms; 2: 2.048 ms <= 3 ms -> keep 2
    assert retained_layers(1000, 3e-3, OFFLOAD) == 2
    assert retained_layers(1000, 1.0, OFFLOAD) == 0   # a long prefill hides every layer
    assert retained_layers(1000, 0.0, OFFLOAD) == 4   # nothing to hide under


def test_longer_prompts_keep_no_more_layers():
    lengths = [16, 64, 256, 1024, 4096, 16384]
    kept = [retained_layers(n, prefill_time_s(n, PREFILL), OFFLOAD) for n in lengths]
    assert kept == sorted(kept, reverse=True)


@given(st.integers(1, 8192), st.integers(1, 8192), st.floats(1e7, 1e10), st.floats(1e6, 1e9))
def test_retained_layers_never_grow_with_the_prompt(a, b, flops, bandwidth):
    # Eq. 3 over seqlen grows with seqlen while Eq. 4 over seqlen is constant: x can only fall
    prefill = PrefillCost(alpha=1.0, num_params=10**5, hidden_size=256, flops_per_s=flops)
    offload = OffloadCost(beta=1.0, num_layers=8, head_dim=64, num_kv_heads=2, bytes_per_element=2,
                          bandwidth_bytes_per_s=bandwidth)
    short, long = sorted((a, b))
    assert (retained_layers(long, prefill_time_s(long, prefill), offload)
            <= retained_layers(short, prefill_time_s(short, prefill), offload))


@pytest.mark.parametrize("layers, keep, expected", [
    (8, 4, (1, 3, 5, 7)),      # LayerKV 3.1.2's example
    (8, 2, (3, 7)),
    (8, 8, tuple(range(8))),
    (8, 0, ()),
    (32, 3, (9, 20, 31)),
    (1, 1, (0,)),
])
def test_interleaved_layers(layers, keep, expected):
    assert interleaved(layers, keep) == expected


@given(st.integers(1, 96), st.data())
def test_interleaved_keeps_that_many_distinct_layers_in_range(layers, data):
    keep = data.draw(st.integers(0, layers))
    kept = interleaved(layers, keep)
    assert len(kept) == len(set(kept)) == keep and list(kept) == sorted(kept)
    assert all(0 <= layer < layers for layer in kept) and (not kept or kept[-1] == layers - 1)


# -- Eq. 5 and the offloading it triggers --------------------------------------------------------

def running_pair() -> list[RequestView]:
    # a: median 3, 1 generated -> ends at step 2; 2 device layers of 3 blocks (6 held)
    # b: no prediction -> ends at max_tokens 100; every layer (4) of 1 block
    return [view("a", num_generated=1, predicted_output_median=3, device_layers=2, blocks_per_layer=3, scheduled_at=5.0),
            view("b", max_tokens=100, blocks_per_layer=1, scheduled_at=3.0)]


def test_eq5_forecast():
    # t=1: 10 - (2 + 4) = 4; t=2: a releases 6 + 2 grown = 8, b takes 4: 8; t=3: b takes 4: 4
    assert forecast_free_blocks(10, running_pair(), num_layers=4, stages=3) == [4, 8, 4]
    # with 16-token blocks a stage is 16 decode steps: a's 2 tokens left end it in stage 1, releasing its 6
    assert forecast_free_blocks(10, running_pair(), num_layers=4, stages=2, block_size=16) == [12, 8]


def test_eq5_reads_the_median_before_the_estimate():
    # median 0 is a prediction (ends at step 1, releasing 4 layers x 2 blocks), not a missing one:
    # t=1: 10 + 8 = 18; with the fallback (max_tokens 100) it would take 4 a step: 6, 2
    ending = view("c", num_generated=5, predicted_output_median=0, predicted_output_len=100, blocks_per_layer=2)
    assert forecast_free_blocks(10, [ending], num_layers=4, stages=2) == [18, 18]


def inp(threshold: int, running: list[RequestView], admitting=()) -> OffloadInput:
    return OffloadInput(admitting=list(admitting), running=running, pool=pool(free=10), now=0.0,
                        params=OffloadParams(threshold_blocks=threshold, horizon_stages=3))


def test_a_forecast_shortfall_halves_the_most_recent_first():
    # the forecast's low is 4; a threshold of 8 is 4 short: a (newest) 2 -> 1 frees 3, b 4 -> 2 frees 2
    assert layerkv(inp(8, running_pair())).shrink == {"a": 1, "b": 2}
    # 5 short: the same halving covers it
    assert layerkv(inp(9, running_pair())).shrink == {"a": 1, "b": 2}
    # 1 short: halving a alone is enough
    assert layerkv(inp(5, running_pair())).shrink == {"a": 1}


def test_when_halving_is_not_enough_every_layer_goes():
    # 16 short: halving frees 5, taking both to none frees 3 + 2 more: still short, all are offloaded
    assert layerkv(inp(20, running_pair())).shrink == {"a": 0, "b": 0}


def test_no_shortfall_no_offloading_and_x_for_each_admitted_request():
    plan = layerkv(inp(0, running_pair(), admitting=[view("w", num_tokens=1000)]))
    assert plan.shrink == {}
    assert plan.retain == {"w": retained_layers(1000, prefill_time_s(1000, PREFILL), OFFLOAD)}


def test_a_request_keeps_every_layer_while_the_forecast_has_room_for_them():
    admitting = [view("w1"), view("w2"), view("w3", num_tokens=1000), view("w4")]

    def retain(threshold: int, running: list[RequestView]) -> dict[str, int]:
        return layerkv(OffloadInput(admitting=admitting, running=running, pool=pool(free=100), now=0.0,
                                    params=OffloadParams(threshold_blocks=threshold, horizon_stages=3))).retain

    # 90 above the threshold; a 100-token prompt keeps its 7 blocks and 3 stages of growth on every
    # layer: 4 x 10 = 40. w1 and w2 take 80; w3 (63 + 3 blocks a layer) does not fit in 10 and keeps
    # x = 0 (Eq. 4: its 5.0 s prefill hides a 4 ms offload), its staging takes 2 x 63; w4 then gets x.
    assert retain(10, []) == {"w1": 4, "w2": 4, "w3": 0, "w4": 0}
    # A running request with every layer offloaded stages 5 blocks a layer each step: 2 x 5 less room.
    # 100 - 20 - 10 = 70: w1 takes 40, w2's 40 no longer fits in 30: it keeps what fits beside its
    # own staging's 2 x 7, (30 - 14) // 10 = 1 layer, more than its x = 0; 6 are left, w3 and w4 get x.
    staged = view("s", device_layers=0, blocks_per_layer=5, predicted_output_median=90)
    assert retain(20, [staged]) == {"w1": 4, "w2": 1, "w3": 0, "w4": 0}
    # At a threshold of 14, 100 - 14 - 10 = 76: w1 40, then w2 (36 - 14) // 10 = 2 layers, 2 left
    assert retain(14, [staged]) == {"w1": 4, "w2": 2, "w3": 0, "w4": 0}
    assert retain(20, []) == {"w1": 4, "w2": 4, "w3": 0, "w4": 0}


def test_without_a_profile_every_layer_is_retained_and_none_offloads_nothing():
    unprofiled = OffloadInput(admitting=[view("w")], running=[], pool=pool(prefill=None), now=0.0)
    assert layerkv(unprofiled).retain == {}
    assert none(inp(100, running_pair())) == none(unprofiled) and not none(unprofiled).shrink


def test_room_above_the_threshold_brings_offloaded_layers_back_earliest_first():
    """Decodes that stage their offloaded layers every step: restores take the room left, layer by layer."""
    running = [view("a", device_layers=2, blocks_per_layer=3, scheduled_at=5.0, predicted_output_median=90),
               view("b", device_layers=0, blocks_per_layer=1, scheduled_at=3.0, predicted_output_median=90)]
    roomy = OffloadInput(admitting=[], running=running, pool=pool(free=100), now=0.0,
                         params=staged(10))
    # forecast 100 - 2 a stage: low 94, 84 above the threshold, less 2 x (3 + 1) blocks the two
    # stage each step: 76; a layer back costs its blocks and 3 stages of growth: b (first scheduled)
    # 4 x (1 + 3) = 16, then a 2 x (3 + 3) = 12
    assert layerkv(roomy).restore == {"b": 4, "a": 2} and not layerkv(roomy).shrink
    tight = OffloadInput(admitting=[], running=running, pool=pool(free=100), now=0.0,
                         params=staged(77))
    # 17 above the threshold, 9 past the staging: 2 of b's layers (4 each); then a's first costs 6:
    # no room, and nobody overtakes a
    assert layerkv(tight).restore == {"b": 2}
    staged_only = OffloadInput(admitting=[], running=running, pool=pool(free=100), now=0.0,
                               params=staged(87))
    assert layerkv(staged_only).restore == {}  # 7 above the threshold: the staging's 8 take it all
    # A request about to be admitted gets the room first. At a threshold of 40, 46 are above it and
    # past the staging; w's 100 tokens on every layer take 4 x (7 + 3) = 40: one of b's layers fits
    # in the 6 left. Without w, all of b's (16) and both of a's (12).
    def queued(admitting) -> dict[str, int]:
        return layerkv(OffloadInput(admitting=admitting, running=running, pool=pool(free=100), now=0.0,
                                    params=staged(40))).restore
    assert queued([view("w")]) == {"b": 1}
    assert queued([]) == {"b": 4, "a": 2}
    # unprofiled, w keeps every layer all the same: the room it takes is the same
    assert layerkv(OffloadInput(admitting=[view("w")], running=running, pool=pool(free=100, prefill=None), now=0.0,
                                params=staged(40))).restore == {"b": 1}


def test_free_blocks_below_the_threshold_now_offload_even_if_the_forecast_recovers():
    # both end within the first 16-step stage: Eq. 5 sees 10 + 6 + 4 = 20 free after it, but 10 are free now
    ending = [view("a", num_generated=1, predicted_output_median=3, device_layers=2, blocks_per_layer=3, scheduled_at=5.0),
              view("b", num_generated=1, predicted_output_median=3, blocks_per_layer=1, scheduled_at=3.0)]
    assert layerkv(inp(12, ending)).shrink == {"a": 1}
