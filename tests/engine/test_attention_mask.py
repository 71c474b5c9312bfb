"""Paged attention with a per-slot key mask (valid), both backends against dense attention over
the kept keys only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvmesh.services.engine.native.attention import StepAttention, paged, paged_attention, write_kv

from .test_paged_attention import (  # noqa: F401 - fixtures: the kernel, the backend, two threads
    MIXED,
    TOLERANCE,
    Batch,
    backend_name,
    kernel,
    make_batch,
    two_threads,
    use_backend,
)

# MIXED, and decodes and a prefill chunk after long contexts: several key tiles of the decode
# path (256 keys each) and many blocks of the prefill path. make_valid masks every key before the
# queries of sequences 1, 4, 7, 10 and 13: (50, 20) leaves the prefill path's first blocks, and
# (300, 2) the decode path's first tile, without a single kept key.
SEQUENCES = [*MIXED, (600, 1), (300, 40), (300, 2)]
SHAPES = [(64, 16), (48, 32), (64, 32)]  # (head_dim, block_size); 48 is no whole number of vectors


def masked_batch(group: int, head_dim: int, block_size: int, dtype: torch.dtype, seed: int = 0) -> Batch:
    seq_lens, n_qs = zip(*SEQUENCES)
    return make_batch(list(seq_lens), list(n_qs), hq=2 * group, hkv=2, head_dim=head_dim, block_size=block_size,
                      dtype=dtype, seed=seed)


def key_slots(batch: Batch, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (block, offset) of each of sequence s's keys."""
    positions = torch.arange(int(batch.seq_lens[s]))
    block_size = batch.pool.shape[2]
    return batch.block_table[s, positions // block_size].long(), positions % block_size


def make_valid(batch: Batch, seed: int = 0) -> torch.Tensor:
    """A mask over the pool keeping each query's own key. Sequence s keeps a random share of its
    other keys (s % 3 == 0), or none of those before its first query (1: whole tiles and blocks
    masked, before any kept key), or none in every other block (2)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size = batch.pool.shape[0], batch.pool.shape[2]
    valid = torch.rand(num_blocks, block_size, generator=gen) < torch.rand(num_blocks, 1, generator=gen) * 0.8 + 0.1
    for s in range(len(batch.seq_lens)):
        blocks, offsets = key_slots(batch, s)
        context = len(blocks) - int(batch.query_start_loc[s + 1] - batch.query_start_loc[s])
        if s % 3 == 1:
            valid[blocks[:context], offsets[:context]] = False
        elif s % 3 == 2:
            valid[blocks.unique()[::2]] = False
        valid[blocks[context:], offsets[context:]] = True
    return valid


def masked_reference(batch: Batch, valid: torch.Tensor) -> torch.Tensor:
    """Dense causal SDPA per sequence in float32 over the kept keys only (masked ones removed)."""
    q, pool = batch.q.float(), batch.pool.float()
    group = q.shape[1] // pool.shape[3]
    out = torch.zeros_like(q)
    for s, n in enumerate(batch.seq_lens.tolist()):
        begin, end = batch.query_start_loc[s].item(), batch.query_start_loc[s + 1].item()
        if begin == end:
            continue
        blocks, offsets = key_slots(batch, s)
        kept = valid[blocks, offsets]
        positions = torch.arange(n)[kept]
        k = pool[blocks[kept], 0, offsets[kept]].repeat_interleave(group, 1).transpose(0, 1)
        v = pool[blocks[kept], 1, offsets[kept]].repeat_interleave(group, 1).transpose(0, 1)
        query_pos = n - (end - begin) + torch.arange(end - begin)
        mask = positions[None, :] <= query_pos[:, None]
        out[begin:end] = F.scaled_dot_product_attention(q[begin:end].transpose(0, 1), k, v, attn_mask=mask,
                                                        scale=batch.scale).transpose(0, 1)
    return out


def fill_masked(pool: torch.Tensor, valid: torch.Tensor, values: torch.Tensor | float) -> torch.Tensor:
    """A copy of pool whose masked slots (K and V) hold values."""
    pool = pool.clone()
    pool.transpose(1, 2)[~valid] = values if isinstance(values, float) else values.to(pool.dtype)
    return pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize(("head_dim", "block_size"), SHAPES)
def test_masked_keys_are_left_out(backend_name: str, dtype: torch.dtype, group: int, head_dim: int,
                                  block_size: int) -> None:
    batch = masked_batch(group, head_dim, block_size, dtype)
    valid = make_valid(batch)
    out = paged_attention(*batch.args(), valid=valid)
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    expected = masked_reference(batch, valid)
    torch.testing.assert_close(out.float(), expected, **TOLERANCE[dtype])
    # The mask matters: attention over every key is far from it.
    assert not torch.allclose(paged_attention(*batch.args()).float(), expected, **TOLERANCE[dtype])


# Blocks the decode path's key tiles start inside of, and blocks of fewer keys than a vector.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "block_size"), [(40, 24), (32, 8), (8, 1)])
def test_masked_keys_are_left_out_other_block_sizes(backend_name: str, dtype: torch.dtype, head_dim: int,
                                                    block_size: int) -> None:
    batch = masked_batch(2, head_dim, block_size, dtype, seed=5)
    valid = make_valid(batch, seed=5)
    torch.testing.assert_close(paged_attention(*batch.args(), valid=valid).float(), masked_reference(batch, valid),
                               **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize(("head_dim", "block_size"), SHAPES)
def test_mask_keeping_everything_changes_nothing(backend_name: str, dtype: torch.dtype, group: int, head_dim: int,
                                                 block_size: int) -> None:
    batch = masked_batch(group, head_dim, block_size, dtype)
    everything = torch.ones(batch.pool.shape[0], batch.pool.shape[2], dtype=torch.bool)
    assert torch.equal(paged_attention(*batch.args(), valid=everything), paged_attention(*batch.args()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "block_size"), SHAPES)
def test_masked_slots_contents_do_not_matter(backend_name: str, dtype: torch.dtype, head_dim: int,
                                             block_size: int) -> None:
    batch = masked_batch(2, head_dim, block_size, dtype)
    valid = make_valid(batch, seed=1)
    masked = int((~valid).sum())
    garbage = 1e4 * torch.randn(masked, 2, *batch.pool.shape[3:], generator=torch.Generator().manual_seed(3)).sign()
    zeros = paged_attention(batch.q, fill_masked(batch.pool, valid, 0.0), *batch.args()[2:], valid=valid)
    large = paged_attention(batch.q, fill_masked(batch.pool, valid, garbage), *batch.args()[2:], valid=valid)
    assert zeros.isfinite().all()
    assert torch.equal(large, zeros)


def _bad_masks() -> dict[str, tuple[Batch, torch.Tensor]]:
    b = make_batch([5, 3], [2, 1], hq=4, hkv=2, head_dim=8, block_size=4, dtype=torch.float32)
    shape = (b.pool.shape[0], b.pool.shape[2])
    good = torch.ones(shape, dtype=torch.bool)
    return {
        "dtype uint8": (b, good.to(torch.uint8)),
        "dtype float": (b, good.float()),
        "too few blocks": (b, good[:-1]),
        "slots not block_size": (b, torch.ones(shape[0], shape[1] + 1, dtype=torch.bool)),
        "rank 1": (b, good.flatten()),
        "not contiguous": (b, torch.ones(shape[1], shape[0], dtype=torch.bool).T),
    }


@pytest.mark.parametrize("name", list(_bad_masks()))
def test_bad_mask_raises_value_error(backend_name: str, name: str) -> None:
    batch, valid = _bad_masks()[name]
    with pytest.raises(ValueError, match="valid"):
        paged_attention(*batch.args(), valid=valid)


@pytest.mark.parametrize("name", list(_bad_masks()))
def test_kernel_rejects_bad_mask(kernel: object, name: str) -> None:
    batch, valid = _bad_masks()[name]
    with pytest.raises(ValueError, match="valid"):
        kernel.paged_attention(*batch.args(), valid)


def test_step_attention_with_mask_equals_checked_calls(backend_name: str) -> None:
    """Every layer's call, the checked first one and the kernel's later ones, applies the mask."""
    layers, n, block_size, num_blocks = 2, 20, 16, 24
    gen = torch.Generator().manual_seed(4)
    pool = torch.randn(num_blocks, 2, block_size, 2, 64, generator=gen)
    seq_lens = torch.tensor([40, 23], dtype=torch.int32)
    starts = torch.tensor([0, n, n + 1], dtype=torch.int32)
    # Each layer's blocks: 3 for the first sequence and 2 for the second, out of the pool.
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:6].view(2, 3) for _ in range(layers)]).int()
    tables[:, 1, 2] = -1
    # The step's new tokens: the first sequence's last n positions, the second's last one.
    positions = [(0, p) for p in range(40 - n, 40)] + [(1, 22)]
    slots = torch.tensor([[int(tables[layer, s, p // block_size]) * block_size + p % block_size for s, p in positions]
                          for layer in range(layers)])
    valid = torch.rand(num_blocks, block_size, generator=gen) < 0.5
    valid.view(-1)[slots.flatten()] = True  # each query's own key
    q = torch.randn(layers, n + 1, 4, 64, generator=gen)
    k, v = torch.randn(2, layers, n + 1, 2, 64, generator=gen)

    expected_pool, got_pool = pool.clone(), pool.clone()
    step = StepAttention(got_pool, tables, slots, seq_lens, starts, 64**-0.5, valid=valid)
    for layer in range(layers):
        write_kv(expected_pool, k[layer], v[layer], slots[layer])
        batch = Batch(q[layer], expected_pool, tables[layer], seq_lens, starts, 64**-0.5)
        expected = paged_attention(*batch.args(), valid=valid)
        got = step(layer, q[layer], k[layer], v[layer])
        torch.testing.assert_close(got, expected)
        torch.testing.assert_close(got, masked_reference(batch, valid), **TOLERANCE[torch.float32])
        assert not torch.allclose(got, paged_attention(*batch.args()), **TOLERANCE[torch.float32])
    assert torch.equal(got_pool, expected_pool)


def test_masked_result_does_not_depend_on_thread_count(kernel: object, monkeypatch: pytest.MonkeyPatch) -> None:
    use_backend(monkeypatch, "cpp")
    batch = masked_batch(2, 64, 16, torch.float32)
    valid = make_valid(batch)
    two = paged_attention(*batch.args(), valid=valid)
    torch.set_num_threads(1)
    try:
        assert torch.equal(paged_attention(*batch.args(), valid=valid), two)
    finally:
        torch.set_num_threads(2)
        paged._kernel.cache_clear()
