"""A step's shape as the step cost reads it (prefill tokens, decode tokens, decode context, prefill
context, prefill sequences), counted in one place: the native engine records each step's shape with it
and the simulator (sim/engine.py) schedules steps of the same shape, so a cost fitted to the engine's
steps reads the simulator's alike."""

from __future__ import annotations

from collections.abc import Iterable

Shape = tuple[int, int, int, int, int]  # as FIELDS names them
FIELDS = ("prefill_tokens", "decode_tokens", "decode_context", "prefill_context", "prefill_sequences")


def chunk_shape(prompt_len: int, num_computed: int, n: int) -> Shape:
    """A chunk of `n` tokens after `num_computed` as (prefill tokens, decode tokens, decode context,
    prefill context, prefill sequences): a decode when it computes one generated token's KV. Its context
    is the KV its attention reads, summed over its tokens (each reads itself and every token before it):
    for a decode, its whole context; for a prompt chunk, (query, key) pairs. A prompt chunk is one
    prefill sequence: what a step pays per request prefilling, whatever its length (on a CPU a short
    prompt's chunk costs several times its tokens' share of a long one's)."""
    context = n * num_computed + n * (n + 1) // 2
    return (0, 1, context, 0, 0) if n == 1 and num_computed >= prompt_len else (n, 0, 0, context, 1)


def step_shape(chunks: Iterable[tuple[int, int, int]]) -> Shape:
    """The step of these chunks, each (prompt length, tokens computed before, tokens it computes)."""
    total = (0, 0, 0, 0, 0)
    for chunk in chunks:
        total = tuple(a + b for a, b in zip(total, chunk_shape(*chunk)))
    return total
