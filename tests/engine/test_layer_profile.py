"""LayerKV's start-up profile on the engine's own model and pools: Eq. 3 and Eq. 4 fitted with
positive terms, and every block it borrowed free again."""

from __future__ import annotations

from kvmesh.policies.offload import retained_layers
from kvmesh.policies.prefill_admission import prefill_time_s

from .conftest import assert_all_blocks_free, engine_for


def test_a_layerkv_engine_fits_eq3_and_eq4_at_start(tiny_checkpoint):
    engine = engine_for(tiny_checkpoint, policies={"prefill_admission": "layerkv"}, token_budget=64)
    profile = engine.layer_profile
    assert profile is not None and profile.prefill_cost is not None and profile.offload_cost is not None
    assert profile.prefill_cost.alpha > 0 and profile.prefill_cost.flops_per_s > 0
    assert profile.offload_cost.beta > 0 and profile.offload_cost.bandwidth_bytes_per_s > 0
    assert profile.prefill_cost.num_params == sum(p.numel() for p in engine.runner.model.parameters())
    assert len(profile.prefill_s) == len(profile.lengths) and len(profile.copy_s) == len(profile.copy_blocks)
    # the policies see the fits
    view = engine.blocks.pool_view()
    assert view.prefill_cost == profile.prefill_cost and view.offload_cost == profile.offload_cost
    seqlen = profile.lengths[-1]
    assert 0 <= retained_layers(seqlen, prefill_time_s(seqlen, view.prefill_cost), view.offload_cost) <= 4
    assert engine.state().layer_profile is profile
    assert_all_blocks_free(engine)


def test_profiling_is_off_without_a_layerkv_policy_and_can_be_forced(tiny_checkpoint):
    assert engine_for(tiny_checkpoint).layer_profile is None
    assert engine_for(tiny_checkpoint, layer_profile="on", token_budget=64).layer_profile is not None
    without_cxl = engine_for(tiny_checkpoint, layer_profile="on", token_budget=64, cxl_blocks=0, cxl_bytes=0)
    assert without_cxl.layer_profile.prefill_cost is not None and without_cxl.layer_profile.offload_cost is None
