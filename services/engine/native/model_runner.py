"""Tensors in, logits out: turns a step's chunks into one flattened batch and runs the model.

Every token of every scheduled request goes into one batch (prefill chunks and decodes together).
The attention callable handed to the model writes each layer's new K/V into the request's blocks
of that layer, then attends over the blocks in place. Everything the attention needs is built once
per step, for all layers at once, with numpy.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from itertools import accumulate

import numpy as np
import torch

from kvmesh.policies.iteration import ScheduledChunk

from .attention import StepAttention
from .attention.fused import padded_rows
from .kv_pool import KVPool
from .layer_staging import LayerLoads, LayerStaging, NodeLoads, SideCopies
from .request import Request
from .token_scores import ScoreProbe


class ModelRunner:
    def __init__(self, model: torch.nn.Module, pool: KVPool, num_layers: int, head_dim: int,
                 staging: LayerStaging | None = None, reload_side: SideCopies | None = None,
                 probe: ScoreProbe | None = None):
        self.model, self.pool, self.num_layers = model, pool, num_layers
        self.probe = probe  # CaR III-D: scores the tokens that observation queries attend to
        self.staging = staging  # LayerKV: where layers whose KV is in the cxl tier are computed
        self.reload_side = reload_side  # CaR: what copies reloaded and prefetched prefix-cache nodes in
        self.block_size = pool.shape.block_size
        self.scale = head_dim ** -0.5
        self.device = pool.tensor.device
        self._rows: dict[str, tuple[list[list[int]], np.ndarray]] = {}  # see _block_tables
        self._tables: tuple[list[np.ndarray], np.ndarray] = ([], np.zeros(0))  # last step's rows and tables

    @torch.inference_mode()
    def run(self, chunks: Sequence[ScheduledChunk], loads: NodeLoads | None = None,
            staging: tuple[list[int], list[int]] = ([], []),
            after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """Compute every chunk; logits [n, vocab] (float32) of the chunks that sample, in order.
        `loads`: the prefix-cache nodes copied into the device pool (its reloads each layer before
        that layer's attention, its prefetches under the step);
        `staging`: the device blocks lent for the step's staging area, its two halves (LayerKV);
        `after_layer`: called with each layer's index once its KV is written (push mode)."""
        requests = [c.request for c in chunks]
        lengths = [c.num_tokens for c in chunks]
        query_start = np.array([0, *accumulate(lengths)], dtype=np.int32)
        starts = np.array([r.num_computed for r in requests])
        num_tokens = int(query_start[-1])
        # Token t of sequence s sits at position starts[s] + (t - query_start[s]).
        positions = np.repeat(starts - query_start[:-1], lengths) + np.arange(num_tokens)
        tables = self._block_tables(requests)
        staged = self.staging.prepare(chunks, tables, staging) if self.staging is not None else None
        if staged is not None:
            tables = staged.tables
        seq_of_token = np.repeat(np.arange(len(chunks)), lengths)
        slots = (tables[:, seq_of_token, positions // self.block_size].astype(np.int64) * self.block_size
                 + positions % self.block_size)
        ids = np.array([t for c in chunks for t in _new_ids(c.request, c.num_tokens)], dtype=np.int64)
        # the model runs `rows` rows, the step's tokens and then padding (token 0 at position 0)
        rows = padded_rows(num_tokens, self.pool.tensor.dtype, self.device)

        device = self.device
        block_tables = torch.from_numpy(tables).to(device)
        valid = self._valid(staged is not None)
        attention = StepAttention(self.pool.tensor, block_tables, torch.from_numpy(slots).to(device),
                                  torch.from_numpy((starts + lengths).astype(np.int32)).to(device),
                                  torch.from_numpy(query_start).to(device), self.scale, valid=valid,
                                  prompts=_new_prompts(starts, query_start) if valid is None else (),
                                  padding=rows - num_tokens)
        if self.probe is not None:
            attention = self.probe.wrap(attention, block_tables, self._observed(chunks, starts + lengths, query_start))
        around = []   # the copies each layer's attention waits for, and their ends
        if staged is not None:
            attention, around = staged.wrap(attention), [staged]
        if loads is not None:
            loading = LayerLoads(self.reload_side, loads)
            attention, around = loading.wrap(attention), [loading, *around]
        # A prompt's rows take the dense weights however few the step computes (a prefix-cache hit
        # leaves a short tail), so its KV and first token do not depend on what was cached.
        dense = any(r.num_computed < len(r.prompt_ids) for r in requests)
        try:
            hidden = self.model(torch.from_numpy(_padded(ids, rows)).to(device),
                                torch.from_numpy(_padded(positions, rows)).to(device), attention, dense=dense,
                                after_layer=after_layer)
        finally:
            for copies in around:
                copies.finish()
        hidden = hidden[:num_tokens]
        samples = [c.samples for c in chunks]
        if num_tokens > len(chunks) or not all(samples):  # else each chunk is one sampling token: every row
            last = query_start[1:][samples] - 1
            hidden = hidden[torch.from_numpy(last.astype(np.int64)).to(device)]
        return self.model.logits(hidden, dense=dense)

    def _valid(self, stages: bool) -> torch.Tensor | None:
        """The pool's slot mask when some block may be sparsified (CaR III-D): one of the device
        tier's, or one a staged layer loads this step; else none, and attention takes its unmasked path."""
        pool = self.pool
        return pool.valid if pool.sparse or (pool.valid is not None and stages) else None

    def _observed(self, chunks: Sequence[ScheduledChunk], ends: np.ndarray,
                  query_start: np.ndarray) -> list[tuple[int, int, int]]:
        """The sequences whose last query this step observes (token_scores.py): those whose prompt
        ends here, or whose step fills a block."""
        return [(s, int(query_start[s + 1]) - 1, int(end)) for s, (chunk, end) in enumerate(zip(chunks, ends))
                if end == len(chunk.request.prompt_ids) or end % self.block_size == 0]

    def _block_tables(self, requests: Sequence[Request]) -> np.ndarray:
        """[layers, seqs, widest] int32: row (l, s) holds request s's blocks of layer l, zero-padded.

        A request's blocks change once in block_size steps, and turning Python lists into an array
        costs ~20 ns a block, so each request's rows are kept from the step before while its block
        lists still equal the copy they were built from (0.3 us to compare, 2.3 us to rebuild), and
        the whole array while every row is kept (7 us to assemble for 16 requests)."""
        kept, rows = {}, []
        for request in requests:
            lists = [layer.blocks for layer in request.layers]
            entry = self._rows.get(request.request_id)
            if entry is None or entry[0] != lists:
                entry = [list(blocks) for blocks in lists], np.array(lists, dtype=np.int32)
            kept[request.request_id] = entry
            rows.append(entry[1])
        self._rows = kept  # requests gone from the batch drop out
        last_rows, tables = self._tables
        if len(rows) == len(last_rows) and all(map(operator.is_, rows, last_rows)):
            return tables  # the same rows in the same order (decodes: block_size steps in a row); only read
        tables = np.zeros((self.num_layers, len(requests), max(r.shape[1] for r in rows)), dtype=np.int32)
        for s, request_rows in enumerate(rows):
            tables[:, s, :request_rows.shape[1]] = request_rows
        self._tables = rows, tables
        return tables


def _padded(values: np.ndarray, rows: int) -> np.ndarray:
    """values followed by zeros up to `rows`."""
    return values if len(values) == rows else np.concatenate([values, np.zeros(rows - len(values), values.dtype)])


def _new_prompts(starts: np.ndarray, query_start: np.ndarray) -> list[tuple[int, int]]:
    """The token ranges of the step's last chunks that are each a whole new context: nothing computed
    before them, more than one token (StepAttention's `prompts`). The scheduler admits waiting
    requests after the running ones, so a step's new prompts come last."""
    prompts: list[tuple[int, int]] = []
    for s in range(len(starts) - 1, -1, -1):
        begin, end = int(query_start[s]), int(query_start[s + 1])
        if starts[s] or end - begin < 2:
            break
        prompts.append((begin, end))
    return prompts[::-1]


def _new_ids(request: Request, n: int) -> list[int]:
    """The n tokens after the computed ones: request.all_ids[num_computed:][:n] without joining the
    prompt and the output (a decode needs one token, not a copy of the whole sequence)."""
    start, prompt, output = request.num_computed, request.prompt_ids, request.output_ids
    if start >= len(prompt):
        return output[start - len(prompt):start - len(prompt) + n]
    return prompt[start:start + n] + output[:max(0, start + n - len(prompt))]
