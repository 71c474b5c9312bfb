"""policies.step_shape: a step's shape in exact counts, and the simulator counting as the engine does."""

from __future__ import annotations

import itertools

from kvmesh.policies.step_shape import chunk_shape, step_shape
from kvmesh.sim import engine as sim_engine


def test_a_prompt_chunk_counts_its_query_key_pairs():
    assert chunk_shape(prompt_len=100, num_computed=0, n=100) == (100, 0, 0, 100 * 101 // 2)
    assert chunk_shape(prompt_len=100, num_computed=60, n=40) == (40, 0, 0, 40 * 60 + 40 * 41 // 2)


def test_a_decode_reads_its_whole_context():
    assert chunk_shape(prompt_len=100, num_computed=104, n=1) == (0, 1, 105, 0)
    assert chunk_shape(prompt_len=1, num_computed=0, n=1) == (1, 0, 0, 1)  # a one-token prompt is a prefill


def test_a_step_sums_its_chunks():
    assert step_shape([(100, 0, 100), (20, 25, 1), (30, 30, 1)]) == (100, 2, 26 + 31, 5050)
    assert step_shape([]) == (0, 0, 0, 0)


def test_the_simulator_counts_chunks_as_the_engine_does():
    for prompt, computed, n in itertools.product((1, 7, 64), (0, 1, 7, 64, 70), (1, 2, 16)):
        assert sim_engine.chunk_shape(prompt, computed, n) == chunk_shape(prompt, computed, n)
