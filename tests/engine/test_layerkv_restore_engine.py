"""LayerKV's decodes in the native engine with `decode_offloaded` "restore": a request whose prefill
left layers in the cxl tier gets them back once and decodes from the device. Greedy output is the
engine's own without any offloading, token for token, no decode is staged, and every block of both
tiers comes back."""

from __future__ import annotations

import pytest

from kvmesh.policies.costs import OffloadCost, PrefillCost
from kvmesh.policies.offload import decodes_next

from .conftest import assert_all_blocks_free, engine_for, run_all
from .test_engine_correctness import GREEDY, prompts


def restoring_engine(tiny_checkpoint, **overrides):
    """A LayerKV engine whose Eq. 4 has an unbounded link (x = 0 for every prompt), its decodes restoring."""
    engine = engine_for(tiny_checkpoint, policies={"layer_offload": "layerkv"}, layer_profile="off",
                        layer_decode="restore", **overrides)
    engine.blocks.use_layer_costs(PrefillCost(alpha=1.0, num_params=10**6, hidden_size=256, flops_per_s=1e9),
                                  OffloadCost(beta=1.0, num_layers=4, head_dim=64, num_kv_heads=2, bytes_per_element=4,
                                              bandwidth_bytes_per_s=float("inf")))
    return engine


def test_restored_layers_decode_as_the_engine_without_offloading(tiny_checkpoint):
    # As in test_layerkv_engine: a threshold of 60% of 256 blocks leaves room for every layer of the
    # first two of these prompts; the last two keep none, and wait after their prefill for their layers.
    batch = prompts(4, seed=4)
    plain = engine_for(tiny_checkpoint, prefix_caching=False)
    expected = [(r.output_ids, r.output_logprobs) for r in run_all(plain, batch, GREEDY)]
    engine = restoring_engine(tiny_checkpoint, device_blocks=256, layer_free_threshold=0.6, prefix_caching=False)
    staged = []
    prepare = engine.runner.staging.prepare

    def recording(chunks, tables, area):
        staged.extend(decodes_next(c.request.view()) for c in chunks if c.request.offloaded)
        return prepare(chunks, tables, area)

    engine.runner.staging.prepare = recording
    requests = run_all(engine, batch, GREEDY)
    assert [r.output_ids for r in requests] == [tokens for tokens, _ in expected]
    for request, (_, logprobs) in zip(requests, expected):
        assert request.output_logprobs == pytest.approx(logprobs, abs=1e-5)
    moved = engine.scheduler.layers_offloaded
    assert moved["admitted"] == 2 * 4 and moved["restored"] == moved["admitted"] + moved["forecast"]
    assert staged and not any(staged), "prefills staged, decodes never"
    assert_all_blocks_free(engine)
