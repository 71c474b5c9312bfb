"""policies.step_shape: a step's shape in exact counts (the native engine records its steps with it and
the simulator's steps are counted by it)."""

from __future__ import annotations

from kvmesh.policies.step_shape import chunk_shape, step_shape


def test_a_prompt_chunk_counts_its_query_key_pairs_and_a_whole_new_prompt_is_a_prefill_sequence():
    assert chunk_shape(prompt_len=100, num_computed=0, n=100) == (100, 0, 0, 100 * 101 // 2, 1)
    assert chunk_shape(prompt_len=100, num_computed=0, n=60) == (60, 0, 0, 60 * 61 // 2, 1)  # a first chunk
    # a chunked prompt's later chunk, or the tail after a prefix-cache hit: attended with the decodes
    assert chunk_shape(prompt_len=100, num_computed=60, n=40) == (40, 0, 0, 40 * 60 + 40 * 41 // 2, 0)


def test_a_decode_reads_its_whole_context():
    assert chunk_shape(prompt_len=100, num_computed=104, n=1) == (0, 1, 105, 0, 0)
    assert chunk_shape(prompt_len=1, num_computed=0, n=1) == (1, 0, 0, 1, 0)  # a one-token prompt is a prefill


def test_a_step_sums_its_chunks_and_counts_its_prompt_chunks():
    assert step_shape([(100, 0, 100), (20, 25, 1), (30, 30, 1)]) == (100, 2, 26 + 31, 5050, 1)
    assert step_shape([(100, 0, 100), (8, 0, 8), (30, 30, 1)]) == (108, 1, 31, 5050 + 36, 2)
    assert step_shape([(100, 0, 100), (300, 200, 8)]) == (108, 0, 0, 5050 + 8 * 200 + 36, 1)
    assert step_shape([]) == (0, 0, 0, 0, 0)
