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
    for a decode, its whole context; for a prompt chunk, (query, key) pairs. A chunk that computes a
    prompt from its first token (more than one token) is a prefill sequence: the native engine gives
    each its own causal attention call in every layer (services/engine/native/attention/paged.py),
    while a tail after a prefix-cache hit, a chunked prompt's later chunks and the decodes share one
    paged call."""
    context = n * num_computed + n * (n + 1) // 2
    if n == 1 and num_computed >= prompt_len:
        return 0, 1, context, 0, 0
    return n, 0, 0, context, int(num_computed == 0 and n > 1)


def step_shape(chunks: Iterable[tuple[int, int, int]]) -> Shape:
    """The step of these chunks, each (prompt length, tokens computed before, tokens it computes)."""
    total = (0, 0, 0, 0, 0)
    for chunk in chunks:
        total = tuple(a + b for a, b in zip(total, chunk_shape(*chunk)))
    return total
