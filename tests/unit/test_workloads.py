"""The serving benchmark's workloads: seeded, inside their bounds, with the means and shapes they state."""

from __future__ import annotations

import numpy as np
import pytest

from kvmesh.bench.workloads import ARXIV, END_ID, FIRST_ID, SHAREGPT, WORKLOADS


def test_the_same_seed_gives_the_same_requests():
    assert ARXIV.requests(50, seed=3) == ARXIV.requests(50, seed=3)
    assert ARXIV.requests(50, seed=3) != ARXIV.requests(50, seed=4)


@pytest.mark.parametrize("workload", WORKLOADS.values(), ids=WORKLOADS.keys())
def test_lengths_and_token_ids_stay_inside_their_bounds(workload):
    for request in workload.requests(2000, seed=1):
        assert workload.prompt.low <= len(request.prompt_ids) <= workload.prompt.high
        assert workload.output.low <= request.max_tokens <= workload.output.high
        assert all(FIRST_ID <= t < END_ID for t in request.prompt_ids)


@pytest.mark.parametrize("workload", WORKLOADS.values(), ids=WORKLOADS.keys())
def test_means_are_near_the_stated_ones(workload):
    requests = workload.requests(4000, seed=2)
    assert np.mean([len(r.prompt_ids) for r in requests]) == pytest.approx(workload.prompt.mean, rel=0.05)
    assert np.mean([r.max_tokens for r in requests]) == pytest.approx(workload.output.mean, rel=0.05)


def test_arxiv_answers_are_short_for_their_prompts_and_sharegpt_answers_long_as_in_kvdirect():
    def answer_per_prompt_token(w):
        return w.output.mean / w.prompt.mean

    def paper_answer_per_prompt_token(w):
        return w.paper_output_mean / w.paper_prompt_mean

    ours = answer_per_prompt_token(SHAREGPT) / answer_per_prompt_token(ARXIV)
    papers = paper_answer_per_prompt_token(SHAREGPT) / paper_answer_per_prompt_token(ARXIV)
    assert papers == pytest.approx(19.2, rel=0.01)
    assert papers / 1.5 <= ours <= papers * 1.5
