"""CacheOpt's engine side (issue 7): a request's SLOs and predicted length reach the policies' views,
and the start-up profile of swap vs recompute feeds the `sweet_spot` strategy and `GET /v1/state`."""

from __future__ import annotations

import logging

import msgspec
import pytest

from kvmesh.libs.messages.engine import SamplingParams, Targets
from kvmesh.policies import preemption, registry
from kvmesh.policies.costs import RecomputeCurve, SwapCurve, SwapCurves
from kvmesh.services.engine.native.request import Request, Status

from .conftest import assert_all_blocks_free, engine_for
from .test_engine_correctness import prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# 4 layers x 96 blocks of 16 tokens: two or three of the requests below at once, so some are preempted.
PRESSED = dict(device_blocks=96, prefix_caching=False)


def run(engine, targets: dict[str, Targets] | None = None, seed: int = 2) -> list:
    requests = [engine.add(f"r{i}", p, GREEDY, targets=(targets or {}).get(f"r{i}", Targets()))
                for i, p in enumerate(prompts(6, seed=seed, lengths=(30, 60)))]
    for _ in range(10_000):
        if not engine.scheduler.has_work():
            break
        engine.step()
    assert all(r.finished and r.finish_reason == "length" for r in requests)
    return requests


def test_slos_and_predicted_length_reach_the_preemption_order(tiny_checkpoint, monkeypatch):
    seen: dict[str, tuple[float | None, int | None]] = {}

    def recording(running, pool):
        seen.update({r.request_id: (r.tbt_slo_ms, r.predicted_output_len) for r in running})
        return preemption.cacheopt(running, pool)

    monkeypatch.setitem(registry.HOOKS["preemption_order"], "recording", recording)
    engine = engine_for(tiny_checkpoint, **PRESSED, policies={"preemption_order": "recording"})
    targets = {f"r{i}": Targets(ttft_slo_ms=1000.0, tbt_slo_ms=100.0 * (i + 1), predicted_output_len=5 + i)
               for i in range(6)}
    run(engine, targets)
    assert engine.preemptions["recompute"] > 0 and len(seen) >= 2
    assert seen == {r: (targets[r].tbt_slo_ms, targets[r].predicted_output_len) for r in seen}
    assert_all_blocks_free(engine)


def test_the_profile_feeds_sweet_spot_and_shows_in_state(tiny_checkpoint):
    engine = engine_for(tiny_checkpoint, **PRESSED, policies={"preemption_strategy": "sweet_spot"})
    profile = engine.swap_profile
    context = 96 // 4 * 16
    assert len(profile.lengths) >= 4 and profile.lengths[0] == 16 and profile.lengths[-1] == context
    assert len(profile.recompute_s) == len(profile.swap_s) == len(profile.lengths)
    assert profile.curves is not None and engine.blocks.pool_view().swap_curves is profile.curves
    state = msgspec.json.decode(msgspec.json.encode(engine.state()))["swap_profile"]
    assert state["curves"]["sweet_spot"] == profile.curves.sweet_spot and set(state["curves"]["recompute"]) == set("abke")
    assert_all_blocks_free(engine)  # profiling gave back every block it used
    run(engine)
    assert sum(engine.preemptions.values()) > 0
    assert_all_blocks_free(engine)


@pytest.mark.parametrize("recompute_slope, strategy", [(1e-3, "swap"), (1e-9, "recompute")])
def test_sweet_spot_swaps_only_past_the_crossing(tiny_checkpoint, recompute_slope, strategy):
    """Recompute far dearer than swap: every victim swaps; far cheaper: every victim recomputes."""
    engine = engine_for(tiny_checkpoint, **PRESSED, policies={"preemption_strategy": "sweet_spot"},
                        swap_profile="off")
    engine.blocks.use_swap_curves(SwapCurves.of(RecomputeCurve(a=1e-12, b=2.0, k=recompute_slope, e=0.0),
                                                SwapCurve(g=1e-6, d=0.0)))
    run(engine)
    assert engine.preemptions[strategy] > 0 and sum(engine.preemptions.values()) == engine.preemptions[strategy]
    assert_all_blocks_free(engine)


def test_profiling_is_off_for_strategies_that_ignore_it_and_a_failed_fit_leaves_no_curves(tiny_checkpoint, caplog):
    assert engine_for(tiny_checkpoint).swap_profile is None  # recompute: nothing would read the curves
    assert engine_for(tiny_checkpoint, policies={"preemption_strategy": "sweet_spot"},
                      swap_profile="off").swap_profile is None
    with caplog.at_level(logging.WARNING):
        engine = engine_for(tiny_checkpoint, swap_profile="on", swap_profile_lengths=[16, 32, 48], swap_profile_repeats=1)
    assert engine.swap_profile.lengths == [16, 32, 48] and engine.swap_profile.curves is None
    assert engine.blocks.pool_view().swap_curves is None and "no curves fitted" in caplog.text


# -- CacheOpt 3.3: allocation ---------------------------------------------------------------------

def test_underprovisioned_requests_grow_instead_of_being_preempted(tiny_checkpoint):
    """Every request is predicted 2 tokens and makes 12: under block allocation the pool runs dry and
    requests are preempted; under CacheOpt's ledger none is, as each one that runs out of its
    allocation gets more on demand or from the global reservation, and the tokens are the same."""
    underestimated = {f"r{i}": Targets(predicted_output_len=2) for i in range(6)}
    block = engine_for(tiny_checkpoint, **PRESSED)
    by_block = run(block, underestimated)
    assert block.preemptions["recompute"] > 0
    engine = engine_for(tiny_checkpoint, **PRESSED, policies={"kv_allocation": "cacheopt"})
    requests = run(engine, underestimated)
    state = engine.state()
    assert state.preemptions == {"recompute": 0, "swap": 0}
    assert state.allocations_grown["unallocated"] > 0 and state.allocations_grown["reserved"] > 0
    assert [r.output_ids for r in requests] == [r.output_ids for r in by_block]
    assert_all_blocks_free(engine)
    assert engine.scheduler.ledger.unallocated_tokens() == (96 // 4 - 8) * 16  # all but the reservation


@pytest.mark.parametrize("allocation", ["estimate", "s3", "cacheopt"])
def test_no_request_starves_under_any_allocation_policy(tiny_checkpoint, allocation):
    """Estimates wrong both ways and tight SLOs: every request still finishes and the KV comes back."""
    targets = {f"r{i}": Targets(ttft_slo_ms=50.0 * (i + 1), tbt_slo_ms=20.0, predicted_output_len=[1, 40][i % 2])
               for i in range(6)}
    engine = engine_for(tiny_checkpoint, **PRESSED, policies={"kv_allocation": allocation})
    run(engine, targets)
    assert_all_blocks_free(engine)
    assert engine.scheduler.ledger.unallocated_tokens() == (96 // 4 - 8) * 16


@pytest.mark.parametrize("allocation", ["estimate", "s3"])
def test_a_request_estimated_past_the_unallocated_kv_runs_on_an_idle_engine(tiny_checkpoint, allocation):
    """Its prompt and estimate (100 + 200 tokens) exceed A'_kvc (16 blocks of 16 once the reservation
    is set aside) but fit the device: with nothing else running nobody would free KV, so it may have
    the reservation too rather than wait for ever."""
    engine = engine_for(tiny_checkpoint, **PRESSED, policies={"kv_allocation": allocation})
    assert engine.scheduler.ledger.unallocated_tokens() < 100 + 200 <= 96 // 4 * 16
    [prompt] = prompts(1, seed=3, lengths=(100, 101))
    request = engine.add("long", prompt, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True),
                         targets=Targets(predicted_output_len=200))
    for _ in range(1_000):
        if not engine.scheduler.has_work():
            break
        engine.step()
    assert request.finished and len(request.output_ids) == 200 and engine.preemptions["recompute"] == 0
    assert_all_blocks_free(engine)


def test_room_made_for_a_critical_request_goes_to_it_not_back_to_the_victim():
    """D_kvc preemption swaps a running request out so a waiting one about to miss its TTFT SLO can
    start; in that step the victim does not come straight back (it would take the room, and the two
    would take turns being swapped, step after step)."""
    from .test_block_accounting import LAYERS, make

    blocks, scheduler = make(strategy="swap", device_blocks=12, allocation="cacheopt")
    roomy = Request("roomy", [1] * 8, SamplingParams(max_tokens=20), 0.0, LAYERS,
                    targets=Targets(predicted_output_len=8))
    scheduler.add(roomy)
    scheduler.schedule(0.0)  # admitted, allotted its whole demand: 16 of the 16 unallocated tokens
    roomy.num_computed, roomy.output_ids, roomy.output_times = 8, [1], [0.1]
    scheduler.iteration_s.append(0.5)  # T_I^max
    urgent = Request("urgent", [2] * 6, SamplingParams(max_tokens=4), 1.0, LAYERS,
                     targets=Targets(ttft_slo_ms=300.0, predicted_output_len=2))
    scheduler.add(urgent)
    plan = scheduler.schedule(1.0)
    assert [(r.request_id, how) for r, how in plan.preempted] == [("roomy", "swap")]
    assert [c.request.request_id for c in plan.chunks] == ["urgent"] and roomy.status is Status.SWAPPED
