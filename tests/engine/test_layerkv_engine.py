"""LayerKV in the engine: layers kept in the cxl tier are computed in the staging area, loaded ahead
and written back around their attention; greedy output stays transformers' to the token, and every
block of both tiers comes back."""

from __future__ import annotations

import pytest

from kvmesh.libs.controlplane import ConfigError
from kvmesh.libs.messages.engine import SamplingParams, Targets
from kvmesh.policies import registry
from kvmesh.policies.costs import OffloadCost, PrefillCost
from kvmesh.policies.offload.plan import OffloadPlan
from kvmesh.services.engine.native.layer_staging import ChunkedCopier

from .conftest import assert_all_blocks_free, engine_for, run_all
from .test_engine_correctness import GREEDY, check, prompts, reference  # noqa: F401 (a fixture)

LAYERKV = {"layer_offload": "layerkv"}


# Decodes load their offloaded layers into the staging area every step (the default restores them
# once: tests/engine/test_layerkv_restore_engine.py); these tests' policies plan no restores.
STAGE = {"layer_decode": "stage"}


def keep(layers: int):
    """An offload policy that keeps `layers` layers of every admitted request on the device."""
    return lambda inp: OffloadPlan(retain={r.request_id: layers for r in inp.admitting})


@pytest.mark.parametrize("kept,thread", [(0, False), (1, False), (2, False), (1, True)])
def test_offloaded_layers_keep_greedy_output_identical(tiny_checkpoint, reference, monkeypatch, kept, thread):
    monkeypatch.setitem(registry.HOOKS["layer_offload"], "keep", keep(kept))
    # A small token budget splits prompts across steps: later chunks load the earlier ones' KV.
    engine = engine_for(tiny_checkpoint, token_budget=32, policies={"layer_offload": "keep"}, layer_profile="off",
                        prefix_caching=False, layer_copy_thread=thread, **STAGE)
    check(run_all(engine, prompts(5, seed=3, lengths=(20, 90)), GREEDY), reference)
    assert engine.scheduler.layers_offloaded["admitted"] == 5 * (4 - kept)
    assert_all_blocks_free(engine)


def layerkv_engine(tiny_checkpoint, **overrides):
    """A LayerKV engine whose Eq. 4 has an unbounded link: it costs nothing to hide, x = 0 for every prompt."""
    engine = engine_for(tiny_checkpoint, policies=LAYERKV, layer_profile="off", **overrides)
    engine.blocks.use_layer_costs(PrefillCost(alpha=1.0, num_params=10**6, hidden_size=256, flops_per_s=1e9),
                                  OffloadCost(beta=1.0, num_layers=4, head_dim=64, num_kv_heads=2, bytes_per_element=4,
                                              bandwidth_bytes_per_s=float("inf")))
    return engine


def test_a_step_record_carries_the_bytes_its_staging_area_copied(tiny_checkpoint, monkeypatch):
    monkeypatch.setitem(registry.HOOKS["layer_offload"], "keep", keep(1))
    engine = engine_for(tiny_checkpoint, policies={"layer_offload": "keep"}, layer_profile="off", prefix_caching=False,
                        **STAGE)
    block = engine.runner.pool.shape.bytes
    engine.add("a", list(range(10, 30)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    engine.step()  # the 20-token prompt in 3 offloaded layers of 2 blocks: both written back, nothing loaded
    assert engine.last_staged_bytes == 3 * 2 * block
    engine.step()  # its first decode: the 2 blocks of context loaded, the second (where it writes) written back
    assert engine.last_staged_bytes == 3 * 3 * block


def test_layerkv_offloads_every_layer_the_device_has_no_room_for(tiny_checkpoint, reference):
    # 153 of 256 blocks held back as the threshold leave 103. Prompts of 33, 36, 40 and 59 tokens
    # need 3, 3, 3 and 4 blocks a layer and 8 stages of growth: 44 blocks for every layer of each of
    # the first two (15 left), then the last two offload every layer (x = 0); back once room returns.
    engine = layerkv_engine(tiny_checkpoint, device_blocks=256, layer_free_threshold=0.6)
    check(run_all(engine, prompts(4, seed=4), GREEDY), reference)
    assert engine.scheduler.layers_offloaded == {"admitted": 2 * 4, "forecast": 0, "restored": 2 * 4}
    assert_all_blocks_free(engine)


def test_layerkv_keeps_every_layer_while_the_device_has_room(tiny_checkpoint, reference):
    engine = layerkv_engine(tiny_checkpoint)
    check(run_all(engine, prompts(4, seed=4), GREEDY), reference)
    assert engine.scheduler.layers_offloaded == {"admitted": 0, "forecast": 0, "restored": 0}
    assert_all_blocks_free(engine)


def test_a_forecast_squeeze_offloads_retained_layers_of_running_requests(tiny_checkpoint, reference, monkeypatch):
    monkeypatch.setitem(registry.HOOKS["layer_offload"], "squeeze", _squeeze)
    engine = engine_for(tiny_checkpoint, policies={"layer_offload": "squeeze"}, layer_profile="off",
                        prefix_caching=False, **STAGE)
    check(run_all(engine, prompts(4, seed=5, lengths=(30, 60)), GREEDY), reference)
    assert engine.scheduler.layers_offloaded["forecast"] > 0
    assert_all_blocks_free(engine)


def _squeeze(inp):
    """Every running request down to half its device layers, then none: as Eq. 5 does when it runs low."""
    return OffloadPlan(shrink={r.request_id: (r.device_layers or 4) // 2 for r in inp.running})


def test_a_busy_link_delays_each_chunk_until_it_is_free(tiny_checkpoint, reference, monkeypatch):
    monkeypatch.setitem(registry.HOOKS["layer_offload"], "keep", keep(1))
    engine = engine_for(tiny_checkpoint, policies={"layer_offload": "keep"}, layer_profile="off",
                        layer_copy_chunk_blocks=1, **STAGE)
    link = BusyEveryOtherCheck()
    engine.blocks.copy.link = link
    check(run_all(engine, prompts(3, seed=6), GREEDY), reference)
    assert engine.blocks.copy.waits > 0 and link.checks > engine.blocks.copy.waits
    assert_all_blocks_free(engine)


class BusyEveryOtherCheck:
    """Stands in for a tensor-parallel engine's all-reduce traffic (none on one CPU)."""

    def __init__(self):
        self.checks = 0

    def busy(self) -> bool:
        self.checks += 1
        return self.checks % 2 == 1


def test_a_request_too_long_for_the_staging_area_keeps_every_layer(tiny_checkpoint, reference, monkeypatch):
    monkeypatch.setitem(registry.HOOKS["layer_offload"], "keep", keep(0))
    # Halves of 3 blocks: a 70-token prompt (5 blocks) cannot be staged, a 20-token one can.
    engine = engine_for(tiny_checkpoint, policies={"layer_offload": "keep"}, layer_profile="off",
                        layer_staging_blocks=6, prefix_caching=False, **STAGE)
    short, long = prompts(1, seed=7, lengths=(20, 20))[0], prompts(1, seed=8, lengths=(70, 70))[0]
    requests = run_all(engine, [long, short], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                             logprobs=True))
    check(requests, reference)
    assert engine.scheduler.layers_offloaded["admitted"] == 4  # the short one's
    assert_all_blocks_free(engine)


def test_a_prefill_takes_the_staging_area_before_the_decodes(tiny_checkpoint, reference, monkeypatch):
    monkeypatch.setitem(registry.HOOKS["layer_offload"], "keep", keep(0))
    # Halves of 4 blocks: the decoding request's 2 and the new prompt's 3 do not fit in one step.
    engine = engine_for(tiny_checkpoint, policies={"layer_offload": "keep"}, layer_profile="off",
                        layer_staging_blocks=8, prefix_caching=False, **STAGE)
    first_prompt, late_prompt = prompts(1, seed=11, lengths=(20, 20))[0], prompts(1, seed=12, lengths=(40, 40))[0]
    first = engine.add("first", first_prompt, GREEDY)
    engine.step()
    engine.step()
    late = engine.add("late", late_prompt, GREEDY)
    engine.step()
    # vLLM's order, which LayerKV is built on: the prefill runs, the decode waits a step
    assert (len(first.output_ids), len(late.output_ids)) == (2, 1)
    while engine.scheduler.has_work():
        engine.step()
    check([first, late], reference)
    assert_all_blocks_free(engine)


def test_layer_offload_without_a_cxl_tier_is_a_config_error(tiny_checkpoint):
    with pytest.raises(ConfigError, match="cxl tier"):
        engine_for(tiny_checkpoint, policies=LAYERKV, cxl_blocks=0, cxl_bytes=0, layer_profile="off")


def test_a_staging_area_bigger_than_the_device_tier_is_a_config_error(tiny_checkpoint):
    with pytest.raises(ConfigError, match="staging"):
        engine_for(tiny_checkpoint, device_blocks=64, layer_staging_blocks=65, layer_profile="off")


def test_chunked_copier_splits_copies(tiny_checkpoint):
    engine = engine_for(tiny_checkpoint, layer_staging_blocks=8, layer_profile="off")
    device, cxl = engine.blocks.pools["device"], engine.blocks.pools["cxl"]
    source, target = device.allocate(5), cxl.allocate(5)
    device.tensor[source] = 1.5
    calls = []
    copier = ChunkedCopier(chunk_blocks=2, link=type("Counting", (), {"busy": lambda self: calls.append(1) or False})())
    copier(device, source, cxl, target)
    assert len(calls) == 3 and bool((cxl.tensor[target] == 1.5).all())
    for pool, blocks in ((device, source), (cxl, target)):
        for block in blocks:
            pool.decref(block)
            pool.release(block)
    assert_all_blocks_free(engine)


def test_the_eq5_forecast_offloads_retained_layers_under_a_memory_squeeze(tiny_checkpoint, reference):
    # No profile: admitted requests keep every layer, so only the forecast moves any. 90% of the
    # device tier as the threshold: with three 60-token requests in 96 blocks the forecast runs below it.
    # Staged: restoring, decodes read all their layers, and the forecast takes only idle ones.
    engine = engine_for(tiny_checkpoint, policies=LAYERKV, layer_profile="off", device_blocks=96,
                        layer_staging_blocks=16, layer_free_threshold=0.9, prefix_caching=False, **STAGE)
    check(run_all(engine, prompts(3, seed=9, lengths=(50, 60)), GREEDY), reference)
    moved = engine.scheduler.layers_offloaded
    assert moved["admitted"] == 0 and moved["forecast"] > 0
    assert_all_blocks_free(engine)


def test_slo_aware_admission_holds_prefills_a_decoding_request_has_no_time_for(tiny_checkpoint):
    engine = engine_for(tiny_checkpoint, policies={"prefill_admission": "layerkv"}, layer_profile="off")
    engine.blocks.use_layer_costs(PrefillCost(alpha=1.0, num_params=10**6, hidden_size=256, flops_per_s=1e9), None)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    # A TPOT SLO of 1 us no step meets: once `tight` decodes, its allowance is below any prefill.
    tight = engine.add("tight", list(range(10, 30)), params,
                       targets=Targets(tbt_slo_ms=1e-3, predicted_output_low=8, predicted_output_median=8))
    for _ in range(3):  # its prefill and two decodes
        engine.step()
    late = engine.add("late", list(range(40, 60)), params)
    while not tight.finished:
        engine.step()
        assert late.scheduled_at is None, "admitted while the decoding request had no time to spare"
    while not late.finished:
        engine.step()
    assert late.scheduled_at >= tight.output_times[-1]
    assert_all_blocks_free(engine)


def test_a_request_without_a_predicted_range_gets_the_configured_fallback(tiny_checkpoint):
    engine = engine_for(tiny_checkpoint, output_len_fallback=50, layer_profile="off")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert engine.add("capped", [5, 6, 7], params).targets == Targets(predicted_output_low=8, predicted_output_median=8)
    long = engine.add("long", [5, 6, 7], SamplingParams(max_tokens=200))
    assert (long.targets.predicted_output_low, long.targets.predicted_output_median) == (50, 50)
    given = engine.add("given", [5, 6, 7], params, targets=Targets(predicted_output_low=3, predicted_output_median=5))
    assert (given.targets.predicted_output_low, given.targets.predicted_output_median) == (3, 5)
    for request_id in ("capped", "long", "given"):
        engine.abort(request_id)
    assert_all_blocks_free(engine)
