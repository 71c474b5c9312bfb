"""The real-instruction trace and how the LayerKV bench tells the engine a request's length."""

from __future__ import annotations

from kvmesh.bench.instruction_trace import InstructionTrace, instruction_trace, instructions
from kvmesh.bench.layerkv_traces import targets
from kvmesh.policies.length.padding import Direction
from kvmesh.policies.length.predictors import Prediction


def test_served_instructions_were_never_trained_on_and_every_row_was_answered():
    served, trained = instructions("serve"), instructions("train")
    assert len(served) + len(trained) == 640 and len(served) == 160
    assert {r["instruction"] for r in served}.isdisjoint(r["instruction"] for r in trained)
    assert all(r["output_tokens"] >= 1 and r["finish_reason"] in ("stop", "length") for r in served + trained)


def test_a_request_keeps_its_text_its_prompt_length_and_its_scaled_answer_length():
    rows = {r["instruction"]: r for r in instructions("serve")}
    trace = instruction_trace("serve", 20, output_scale=0.25, seed=3)
    assert trace == instruction_trace("serve", 20, output_scale=0.25, seed=3)   # a function of the seed
    assert len({r.text for r in trace}) == 20
    for request in trace:
        row = rows[request.text]
        assert len(request.prompt_ids) == row["prompt_tokens"]
        assert request.output_len == max(1, round(row["output_tokens"] * 0.25))


def test_the_cacheopt_trace_serves_held_out_instructions_and_trains_on_the_rest():
    trace = InstructionTrace(output_scale=0.25)
    served, training = trace.requests(None, seed=1), trace.training(None, seed=1000)
    assert (len(served), len(training)) == (160, 480)
    assert {r.text for r in served}.isdisjoint(r.text for r in training)
    every = served + training
    assert trace.output.high == max(r.output_len for r in every) == 128   # 512 tokens (the cap) x 0.25
    assert trace.prompt.high == max(len(r.prompt_ids) for r in every)
    assert trace.output.mean == sum(r.output_len for r in every) / 640


def test_the_engine_is_told_what_admission_passes_on_from_the_predictor():
    told = targets([Prediction(100, Direction.UNDER, 10.4, 111, 0.5), Prediction(300, Direction.OVER, 50.0, 250, 0.5)],
                   max_tokens=200, ttft_slo_ms=3000.0, tpot_slo_ms=50.0)
    assert [(t.predicted_output_len, t.predicted_output_median, t.predicted_output_low) for t in told] == \
        [(111, 100, 89), (250, 200, 200)]
    assert all(t.ttft_slo_ms == 3000.0 and t.tbt_slo_ms == 50.0 for t in told)
