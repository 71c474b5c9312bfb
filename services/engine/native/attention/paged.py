"""Paged attention over the KV pool: the contract of docs/engine.md and the choice of backend.

CPU tensors go to the C++ kernel (csrc/paged_attention.cpp) when it builds; everything else, or
KVMESH_ATTENTION=torch, takes the plain-torch path, which runs on any device.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from types import ModuleType

import torch
import torch.nn.functional as F

DTYPES = (torch.float32, torch.bfloat16)
BACKENDS = ("auto", "cpp", "torch")


def write_kv(pool: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """pool[slot // L, 0, slot % L] = k and pool[slot // L, 1, slot % L] = v, for each token's slot."""
    _check_pool(pool)
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != pool.shape[3:]:
        raise ValueError(f"write_kv: k and v must both be [T, {pool.shape[3]}, {pool.shape[4]}], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype != pool.dtype or v.dtype != pool.dtype:
        raise ValueError(f"write_kv: k/v dtypes {k.dtype}/{v.dtype} differ from the pool's {pool.dtype}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != k.shape[:1]:
        raise ValueError(f"write_kv: slot_mapping must be int64 [{k.shape[0]}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    _check_device(pool, k)
    kernel = _kernel() if pool.is_cpu else None
    if kernel is not None:
        kernel.write_kv(pool, _token_rows(k), _token_rows(v), slot_mapping.contiguous())
        return
    block_size = pool.shape[2]
    # In the pool viewed as rows of [Hkv, D], the K row of a slot is 2 * L * block + offset; V is L further.
    k_rows = slot_mapping + (slot_mapping // block_size) * block_size
    rows = pool.view(-1, *pool.shape[3:])
    rows.index_copy_(0, k_rows, k)
    rows.index_copy_(0, k_rows + block_size, v)


def paged_attention(q: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries to its whole context in the pool: [T, Hq, D].

    valid, bool [num_blocks, block_size] (contiguous, on the pool's device), masks keys out: the key
    in block b at offset o takes part only where valid[b, o] is True. Masked slots must hold finite
    values, and each query's own key must be kept.
    """
    _check_pool(pool)
    q_shape, pool_shape = q.shape, pool.shape
    if len(q_shape) != 3 or q_shape[2] != pool_shape[4] or q_shape[1] % pool_shape[3]:
        raise ValueError(f"paged_attention: q must be [T, Hq, {pool_shape[4]}] with Hq a multiple of "
                         f"Hkv={pool_shape[3]}, got {tuple(q_shape)}")
    if q.dtype != pool.dtype:
        raise ValueError(f"paged_attention: q dtype {q.dtype} differs from the pool's {pool.dtype}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"paged_attention: block_table must be int32 [S, M], got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    num_seqs = block_table.shape[0]
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (num_seqs,):
        raise ValueError(f"paged_attention: seq_lens must be int32 [{num_seqs}], got {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)}")
    if query_start_loc.dtype != torch.int32 or query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"paged_attention: query_start_loc must be int32 [{num_seqs + 1}], got "
                         f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    _check_device(pool, q)
    if valid is not None:
        _check_valid(pool, valid)
    kernel = _kernel() if pool.is_cpu else None  # the kernel checks that its index tensors are on the CPU too
    if kernel is not None:
        return kernel.paged_attention(_token_rows(q), pool, block_table.contiguous(), seq_lens.contiguous(),
                                      query_start_loc.contiguous(), float(scale), valid)
    return _torch_paged_attention(q, pool, block_table, seq_lens, query_start_loc, float(scale), valid)


class StepAttention:
    """One step's attention for every layer: write the layer's k and v into the pool, attend.

    The step's index tensors (per-layer tables and slots, shared lengths) and q/k/v's shapes and
    dtypes are the same in every layer, so the first layer's call checks them all and later layers
    go straight to the kernel: eight checked calls cost ~50 us a step, a fair share of a decode step.
    valid (see paged_attention) masks keys in every layer.

    `prompts`: the token ranges [begin, end) of the step's last sequences whose chunk is their whole
    context (a new prompt: nothing computed before it, more than one token). Their keys are this
    step's k and v, so they attend through torch's causal SDPA (a flash kernel on CPU and GPU: half
    the paged kernel's time on a 256-token prompt) rather than through the pool; only the sequences
    before them go to paged attention. Their K/V is written to the pool all the same.

    `padding`: rows the model carries past the step's tokens (fused.padded_rows); their q, k and v are
    ignored and their output is zeros.
    """

    def __init__(self, pool: torch.Tensor, block_tables: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor, scale: float, valid: torch.Tensor | None = None,
                 prompts: Sequence[tuple[int, int]] = (), padding: int = 0):
        self.pool, self.block_tables, self.slots = pool, block_tables, slots
        self.scale, self.valid, self.padding = float(scale), valid, padding
        if prompts and valid is not None:
            raise ValueError("StepAttention: masked keys (valid) and prompts attending to themselves do not mix")
        self.prompts = list(prompts)
        self.paged_seqs = len(seq_lens) - len(self.prompts)  # those before the prompts go through paged attention
        self.seq_lens, self.query_start_loc = seq_lens[:self.paged_seqs], query_start_loc[:self.paged_seqs + 1]
        self._kernel = None  # set once the first layer has passed the checks

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kernel = self._kernel
        tokens = q.shape[0] - self.padding
        if self.padding:
            q, k, v = q[:tokens], k[:tokens], v[:tokens]
        if kernel is None:  # the first layer: checked calls
            write_kv(self.pool, k, v, self.slots[layer])
        else:
            kernel.write_kv(self.pool, _token_rows(k), _token_rows(v), self.slots[layer])
        if not (self.prompts or self.padding):
            out = self._paged(layer, q, kernel)
        else:
            out = q.new_empty(tokens + self.padding, *q.shape[1:])
            out[tokens:] = 0
            if self.paged_seqs:
                paged = self.prompts[0][0] if self.prompts else tokens
                out[:paged] = self._paged(layer, q[:paged], kernel)
            for begin, end in self.prompts:
                out[begin:end] = causal_self_attention(q[begin:end], k[begin:end], v[begin:end], self.scale)
        if kernel is None and self.pool.is_cpu and _kernel() is not None:
            self._kernel = _kernel()  # the kernel reads each layer's row of these densely
            self.block_tables, self.slots = self.block_tables.contiguous(), self.slots.contiguous()
            self.seq_lens, self.query_start_loc = self.seq_lens.contiguous(), self.query_start_loc.contiguous()
        return out

    def _paged(self, layer: int, q: torch.Tensor, kernel: ModuleType | None) -> torch.Tensor:
        table = self.block_tables[layer, :self.paged_seqs]
        if kernel is None:
            return paged_attention(q, self.pool, table, self.seq_lens, self.query_start_loc, self.scale, self.valid)
        return kernel.paged_attention(_token_rows(q), self.pool, table, self.seq_lens, self.query_start_loc,
                                      self.scale, self.valid)


def causal_self_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A new prompt's attention to itself: q [T, Hq, D], k and v [T, Hkv, D] -> [T, Hq, D]."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True, scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


def backend(device: torch.device | str = "cpu") -> str:
    """Which implementation serves tensors on `device`: "cpp" or "torch"."""
    return "cpp" if torch.device(device).type == "cpu" and _kernel() is not None else "torch"


@functools.cache
def _kernel() -> ModuleType | None:
    """The C++ kernel for CPU tensors, or None for the torch path; KVMESH_ATTENTION is read once."""
    choice = os.environ.get("KVMESH_ATTENTION", "auto")
    if choice not in BACKENDS:
        raise ValueError(f"KVMESH_ATTENTION must be one of {', '.join(BACKENDS)}, got {choice!r}")
    if choice == "torch":
        return None
    from .build import load_extension  # here: `python -m ...attention.build` must not find it imported

    kernel = load_extension()
    if kernel is None and choice == "cpp":
        raise RuntimeError("KVMESH_ATTENTION=cpp but the C++ paged-attention kernel did not build (see the log)")
    return kernel


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """[T, H, D] as the kernel reads it: each token's heads contiguous, tokens any stride apart (so
    views into the fused qkv projection go in without a copy)."""
    return x if x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2]) else x.contiguous()


def _check_pool(pool: torch.Tensor) -> None:
    if pool.dim() != 5 or pool.shape[1] != 2:
        raise ValueError(f"KV pool must be [num_blocks, 2, block_size, Hkv, D], got {tuple(pool.shape)}")
    if pool.dtype not in DTYPES:
        raise ValueError(f"KV pool dtype must be float32 or bfloat16, got {pool.dtype}")
    if not pool.is_contiguous():
        raise ValueError("KV pool must be contiguous")


def _check_device(pool: torch.Tensor, tensor: torch.Tensor) -> None:
    if tensor.device != pool.device:
        raise ValueError(f"paged attention: tensors on {tensor.device}, the pool on {pool.device}")


def _check_valid(pool: torch.Tensor, valid: torch.Tensor) -> None:
    shape = (pool.shape[0], pool.shape[2])
    if valid.dtype != torch.bool or valid.shape != shape or not valid.is_contiguous():
        raise ValueError(f"paged_attention: valid must be a contiguous bool [{shape[0]}, {shape[1]}] (one entry "
                         f"per pool slot), got {valid.dtype} {tuple(valid.shape)}"
                         f"{'' if valid.is_contiguous() else ' not contiguous'}")
    _check_device(pool, valid)


def _torch_paged_attention(q: torch.Tensor, pool: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, scale: float, valid: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty_like(q)
    n_q = query_start_loc[1:] - query_start_loc[:-1]
    # Decodes batch without padding; prefill chunks are padded to the longest one among them.
    for group in (n_q == 1, n_q > 1):
        seqs = group.nonzero().squeeze(1)
        if seqs.numel():
            _attend_padded(q, pool, block_table[seqs], seq_lens[seqs].long(), query_start_loc[seqs].long(),
                           n_q[seqs].long(), scale, out, valid)
    return out


def _attend_padded(q: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, seq_lens: torch.Tensor,
                   starts: torch.Tensor, n_q: torch.Tensor, scale: float, out: torch.Tensor,
                   valid: torch.Tensor | None) -> None:
    """SDPA over sequences gathered token by token from the pool and padded to the longest."""
    num_seqs, block_size, device = len(seq_lens), pool.shape[2], q.device
    max_len, max_q = int(seq_lens.max()), int(n_q.max())
    # Key positions past a sequence's end read its position 0: real data (never uninitialised
    # memory that could be NaN and poison 0 * V), and masked out anyway.
    positions = torch.arange(max_len, device=device)
    positions = torch.where(positions < seq_lens[:, None], positions, 0)
    blocks, offsets = table.gather(1, positions // block_size).long(), positions % block_size
    k_rows = (blocks * (2 * block_size) + offsets).flatten()
    kept = None  # [S, 1, max_len]: the keys valid keeps, gathered like K
    if valid is not None:
        kept = valid.view(-1).index_select(0, (blocks * block_size + offsets).flatten()).view(num_seqs, 1, max_len)
    rows = pool.view(-1, *pool.shape[3:])
    # index_select with flat indices: twice as fast as tensor indexing on CPU.
    k = rows.index_select(0, k_rows).view(num_seqs, max_len, *rows.shape[1:]).transpose(1, 2)
    v = rows.index_select(0, k_rows + block_size).view(num_seqs, max_len, *rows.shape[1:]).transpose(1, 2)

    index = torch.arange(max_q, device=device)
    real = index < n_q[:, None]   # [S, max_q]: padding past a sequence's queries is not
    q_rows = torch.where(real, starts[:, None] + index, starts[:, None])  # [S, max_q]
    queries = q.index_select(0, q_rows.flatten()).view(num_seqs, max_q, *q.shape[1:]).transpose(1, 2)
    query_pos = seq_lens[:, None] - n_q[:, None] + index
    mask = torch.arange(max_len, device=device) <= query_pos[:, :, None]  # [S, max_q, max_len]
    if kept is not None:
        mask &= kept
    o = F.scaled_dot_product_attention(queries, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True)
    out[q_rows[real]] = o.transpose(1, 2)[real]
