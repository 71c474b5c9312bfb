"""The roofline step cost of a GPU profile: exact values from its formula (sim/roofline.py)."""

import pytest

from kvmesh.sim.model_shapes import MODELS
from kvmesh.sim.roofline import GPU, Roofline
from kvmesh.sim.step_cost import StepCost, load_profile

A100 = GPU(peak_flops=312e12, hbm_bytes_s=2039e9, mfu=0.5, hbm_efficiency=0.8, allreduce_busbw=200e9,
           allreduce_latency_s=20e-6, overhead_s=1e-3)
OPT_13B = MODELS["opt-13b"]


def test_one_decode_of_opt_13b_at_batch_1_on_an_a100_reads_the_weights_and_its_kv():
    cost = Roofline(OPT_13B, A100, tp=1, dtype_bytes=2)
    weights = (OPT_13B.linear_params + 50272 * 5120) * 2           # blocks and the (tied) LM head, fp16
    kv = 40 * 2 * 40 * 128 * 2 * (1000 + 1)                         # 1,000 tokens read, one written
    assert cost.seconds(0, 1, 1000, 0) == pytest.approx(1e-3 + (weights + kv) / (2039e9 * 0.8), rel=1e-12)


def test_a_step_turns_compute_bound_at_the_batch_the_formula_predicts():
    cost = Roofline(OPT_13B, A100, tp=1, dtype_bytes=2)
    # 2 N t / (F mfu) = (W + k t) / (B eff), for t tokens with no attention pairs
    flops_s, bytes_s = 312e12 * 0.5, 2039e9 * 0.8
    crossover = (cost.weight_bytes_per_gpu / bytes_s) / (2 * OPT_13B.linear_params / flops_s
                                                          - cost.kv_bytes_per_token_per_gpu / bytes_s)
    assert 90 < crossover < 100  # about F mfu / (2 B eff) x 2 bytes a weight
    below, above = int(crossover), int(crossover) + 1
    assert cost.memory_s(below, 0) > cost.compute_s(below, 0)
    assert cost.compute_s(above, 0) > cost.memory_s(above, 0)
    assert cost.seconds(above, 0, 0, 0) == pytest.approx(1e-3 + cost.compute_s(above, 0), rel=1e-12)


def test_tensor_parallelism_divides_the_work_and_adds_two_all_reduces_a_layer():
    one, four = Roofline(OPT_13B, A100, tp=1), Roofline(OPT_13B, A100, tp=4)
    assert four.compute_s(2048, 10**6) == pytest.approx(one.compute_s(2048, 10**6) / 4, rel=1e-12)
    assert four.memory_s(16, 16_000) == pytest.approx(one.memory_s(16, 16_000) / 4, rel=1e-12)
    assert one.allreduce_s(2048) == 0
    ring = 2048 * 5120 * 2 * 2 * 3 / 4 / 200e9
    assert four.allreduce_s(2048) == pytest.approx(2 * 40 * (20e-6 + ring), rel=1e-12)


def test_kv_heads_fewer_than_the_gpus_are_replicated():
    llama = MODELS["llama-2-70b"]  # 8 KV heads
    assert Roofline(llama, A100, tp=16).kv_bytes_per_token_per_gpu == 80 * 2 * 1 * 128 * 2
    assert Roofline(llama, A100, tp=4).kv_bytes_per_token_per_gpu == 80 * 2 * 2 * 128 * 2


def test_load_profile_gives_a_roofline_for_a_gpu_profile_and_a_step_cost_for_the_cpu_one():
    assert isinstance(load_profile("tiny-cpu-bfloat16-1t"), StepCost)
    cost = load_profile("mistral-large-2407-h100-bf16-tp8")
    assert isinstance(cost, Roofline) and cost.tp == 8 and cost.model == MODELS["mistral-large-2407"]
    assert cost.seconds(0, 1, 1000, 0) < cost.seconds(0, 64, 64_000, 0) < cost.seconds(8192, 0, 0, 8192 * 8193 // 2)


def test_cacheopts_opt_13b_decode_at_batch_1_is_its_weights_over_the_a100s_bandwidth_plus_the_overhead():
    cost = load_profile("opt-13b-a100-fp16-tp1")
    weights = 12_840_304_640 * 2                        # OPT-13B's matrices and tied embedding, fp16
    kv = 40 * 2 * 40 * 128 * 2 * 2                      # a 1-token context read and its new token written
    assert cost.seconds(0, 1, 1, 0) == pytest.approx(527e-6 + (weights + kv) / (2039e9 * 0.767), rel=1e-12)


@pytest.mark.parametrize("tp", [1, 4])
def test_a_steps_seconds_are_its_three_terms_to_the_float(tp):
    cost = Roofline(OPT_13B, A100, tp=tp)
    for prefill, decode, decode_context, prefill_context in [(0, 1, 1, 0), (0, 64, 40_000, 0), (96, 0, 0, 4656),
                                                             (300, 90, 31_000, 45_150), (2048, 0, 0, 2_098_176)]:
        tokens = prefill + decode
        assert cost.seconds(prefill, decode, decode_context, prefill_context) == \
            A100.overhead_s + max(cost.compute_s(tokens, decode_context + prefill_context),
                                  cost.memory_s(tokens, decode_context)) + cost.allreduce_s(tokens)
