"""Paged attention and write_kv (docs/engine.md), both backends against dense attention per sequence."""

from __future__ import annotations

import math
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.services.engine.native.attention import backend, paged, paged_attention, write_kv
from kvmesh.services.engine.native.attention.build import load_extension

TOLERANCE = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}}


@pytest.fixture(scope="module", autouse=True)
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def kernel() -> object:
    module = load_extension()  # builds once per virtualenv, then loads
    if module is None:
        if shutil.which("c++") is None:
            pytest.skip("no C++ compiler: the C++ kernel cannot be built")
        pytest.fail("the C++ paged-attention kernel did not build (see the log)")
    return module


def use_backend(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv("KVMESH_ATTENTION", name)
    paged._kernel.cache_clear()  # the choice is read once per process


@pytest.fixture(params=["cpp", "torch"])
def backend_name(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "cpp":
        request.getfixturevalue("kernel")
    use_backend(monkeypatch, request.param)
    assert backend("cpu") == request.param
    yield request.param
    paged._kernel.cache_clear()


@dataclass
class Batch:
    q: torch.Tensor
    pool: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float

    def args(self) -> tuple:
        return self.q, self.pool, self.block_table, self.seq_lens, self.query_start_loc, self.scale


def make_batch(seq_lens: list[int], n_qs: list[int], hq: int, hkv: int, head_dim: int, block_size: int,
               dtype: torch.dtype, seed: int = 0) -> Batch:
    """Blocks scattered over a pool whose every other slot is NaN: reading one would show."""
    gen = torch.Generator().manual_seed(seed)
    counts = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = 2 * sum(counts) + 3
    pool = torch.full((num_blocks, 2, block_size, hkv, head_dim), math.nan, dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(seq_lens), max(counts) + 2), -1, dtype=torch.int32)  # padded
    for s, (n, count) in enumerate(zip(seq_lens, counts)):
        table[s, :count] = torch.tensor([order.pop() for _ in range(count)], dtype=torch.int32)
        positions = torch.arange(n)
        pool[table[s, positions // block_size].long(), :, positions % block_size] = (
            torch.randn(n, 2, hkv, head_dim, generator=gen).to(dtype))
    q = torch.randn(sum(n_qs), hq, head_dim, generator=gen).to(dtype)
    starts = torch.tensor([0, *torch.tensor(n_qs).cumsum(0).tolist()], dtype=torch.int32)
    return Batch(q, pool, table, torch.tensor(seq_lens, dtype=torch.int32), starts, head_dim**-0.5)


def reference(batch: Batch) -> torch.Tensor:
    """Dense causal SDPA per sequence on contiguous K/V, in float32, GQA heads expanded."""
    q, pool = batch.q.float(), batch.pool.float()
    block_size, group = pool.shape[2], q.shape[1] // pool.shape[3]
    out = torch.zeros_like(q)
    for s, n in enumerate(batch.seq_lens.tolist()):
        begin, end = batch.query_start_loc[s].item(), batch.query_start_loc[s + 1].item()
        if begin == end:
            continue
        positions = torch.arange(n)
        blocks = batch.block_table[s, positions // block_size].long()
        k = pool[blocks, 0, positions % block_size].repeat_interleave(group, 1).transpose(0, 1)
        v = pool[blocks, 1, positions % block_size].repeat_interleave(group, 1).transpose(0, 1)
        query_pos = n - (end - begin) + torch.arange(end - begin)
        mask = positions[None, :] <= query_pos[:, None]
        out[begin:end] = F.scaled_dot_product_attention(q[begin:end].transpose(0, 1), k, v, attn_mask=mask,
                                                        scale=batch.scale).transpose(0, 1)
    return out


def check(batch: Batch) -> None:
    out = paged_attention(*batch.args())
    assert out.shape == batch.q.shape and out.dtype == batch.q.dtype
    torch.testing.assert_close(out.float(), reference(batch), **TOLERANCE[batch.q.dtype])


# (seq_len, n_q): a one-token prompt, decodes at and across block boundaries, whole prompts of
# whole blocks and not, prefill chunks after earlier context (short and multi-tile), no queries.
MIXED = [(1, 1), (16, 1), (17, 1), (32, 32), (50, 20), (64, 64), (40, 40), (100, 3), (9, 0), (150, 150), (48, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_mixed_batch_matches_dense_attention(backend_name: str, dtype: torch.dtype, group: int) -> None:
    seq_lens, n_qs = zip(*MIXED)
    check(make_batch(list(seq_lens), list(n_qs), hq=2 * group, hkv=2, head_dim=64, block_size=16, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "block_size", "hkv"), [(40, 8, 2), (128, 32, 1), (32, 16, 4), (8, 1, 1)])
def test_other_head_dims_and_block_sizes(backend_name: str, dtype: torch.dtype, head_dim: int, block_size: int,
                                         hkv: int) -> None:
    seq_lens, n_qs = zip(*MIXED)
    check(make_batch(list(seq_lens), list(n_qs), hq=2 * hkv, hkv=hkv, head_dim=head_dim, block_size=block_size,
                     dtype=dtype))


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    sequences = draw(st.lists(st.integers(1, 90).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n))),
                              min_size=1, max_size=6))
    hkv, group = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([1, 2, 4, 8]))
    seq_lens, n_qs = zip(*sequences)
    return make_batch(list(seq_lens), list(n_qs), hq=hkv * group, hkv=hkv, head_dim=draw(st.sampled_from([8, 24, 64])),
                      block_size=draw(st.sampled_from([1, 4, 16])), dtype=torch.float32, seed=draw(st.integers(0, 99)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=batches())
def test_random_batches_match_dense_attention(backend_name: str, batch: Batch) -> None:
    check(batch)


def test_result_does_not_depend_on_thread_count(kernel: object, monkeypatch: pytest.MonkeyPatch) -> None:
    use_backend(monkeypatch, "cpp")
    seq_lens, n_qs = zip(*MIXED)
    batch = make_batch(list(seq_lens), list(n_qs), hq=4, hkv=2, head_dim=64, block_size=16, dtype=torch.float32)
    two = paged_attention(*batch.args())
    torch.set_num_threads(1)
    try:
        assert torch.equal(paged_attention(*batch.args()), two)
    finally:
        torch.set_num_threads(2)
        paged._kernel.cache_clear()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_torch_path_on_cuda() -> None:
    seq_lens, n_qs = zip(*MIXED)
    batch = make_batch(list(seq_lens), list(n_qs), hq=4, hkv=2, head_dim=64, block_size=16, dtype=torch.float32)
    cuda = replace(batch, **{f: getattr(batch, f).cuda() for f in ("q", "pool", "block_table", "seq_lens",
                                                                   "query_start_loc")})
    assert backend("cuda") == "torch"
    torch.testing.assert_close(paged_attention(*cuda.args()).cpu(), reference(batch), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_writes_each_slot_and_nothing_else(backend_name: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(7, 2, 4, 2, 8, generator=gen).to(dtype)
    k, v = torch.randn(2, 11, 2, 8, generator=gen).to(dtype)
    slots = torch.randperm(7 * 4, generator=gen)[:11]
    expected = pool.clone()
    for t, slot in enumerate(slots.tolist()):
        expected[slot // 4, 0, slot % 4] = k[t]
        expected[slot // 4, 1, slot % 4] = v[t]
    write_kv(pool, k, v, slots)
    assert torch.equal(pool, expected)


def test_write_then_attend_equals_dense_causal_attention(backend_name: str) -> None:
    """The engine's sequence of calls: a prompt written and attended, then one decode step."""
    gen = torch.Generator().manual_seed(2)
    pool = torch.zeros(8, 2, 4, 1, 16)
    table = torch.tensor([[5, 2, 7]], dtype=torch.int32)
    q, k, v = torch.randn(3, 10, 1, 16, generator=gen)
    slots = torch.tensor([table[0, p // 4].item() * 4 + p % 4 for p in range(10)])
    write_kv(pool, k[:9], v[:9], slots[:9])
    prompt = paged_attention(q[:9], pool, table, torch.tensor([9], dtype=torch.int32),
                             torch.tensor([0, 9], dtype=torch.int32), 0.25)
    write_kv(pool, k[9:], v[9:], slots[9:])
    step = paged_attention(q[9:], pool, table, torch.tensor([10], dtype=torch.int32),
                           torch.tensor([0, 1], dtype=torch.int32), 0.25)
    dense = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                           scale=0.25).transpose(0, 1)
    torch.testing.assert_close(torch.cat([prompt, step]), dense, atol=1e-5, rtol=1e-5)


def _bad_calls() -> dict[str, tuple]:
    """Name -> (function, arguments), each breaking one rule of the contract."""
    b = make_batch([5, 3], [2, 1], hq=4, hkv=2, head_dim=8, block_size=4, dtype=torch.float32)
    k = torch.zeros(2, 2, 8)
    slots = torch.tensor([0, 5])
    return {
        "q dtype": (paged_attention, (b.q.bfloat16(), *b.args()[1:])),
        "q head_dim": (paged_attention, (b.q[..., :4], *b.args()[1:])),
        "q heads not a multiple": (paged_attention, (b.q[:, :3], *b.args()[1:])),
        "pool rank": (paged_attention, (b.q, b.pool[0], *b.args()[2:])),
        "pool dtype": (paged_attention, (b.q.half(), b.pool.half(), *b.args()[2:])),
        "pool not contiguous": (paged_attention, (b.q, b.pool.transpose(3, 4).contiguous().transpose(3, 4),
                                                  *b.args()[2:])),
        "block_table dtype": (paged_attention, (b.q, b.pool, b.block_table.long(), *b.args()[3:])),
        "seq_lens length": (paged_attention, (*b.args()[:3], b.seq_lens[:1], *b.args()[4:])),
        "seq_lens dtype": (paged_attention, (*b.args()[:3], b.seq_lens.long(), *b.args()[4:])),
        "query_start_loc length": (paged_attention, (*b.args()[:4], b.query_start_loc[:2], b.scale)),
        "write k shape": (write_kv, (b.pool, k[:, :1], k[:, :1], slots)),
        "write k/v shapes differ": (write_kv, (b.pool, k, k[:1], slots)),
        "write dtype": (write_kv, (b.pool, k.bfloat16(), k.bfloat16(), slots)),
        "write slot dtype": (write_kv, (b.pool, k, k, slots.int())),
        "write slot count": (write_kv, (b.pool, k, k, slots[:1])),
    }


# Values only the C++ kernel checks (it must never read or write outside its tensors).
def _bad_values() -> dict[str, tuple]:
    b = make_batch([5, 3], [2, 1], hq=4, hkv=2, head_dim=8, block_size=4, dtype=torch.float32)
    table = b.block_table.clone()
    table[0, 1] = b.pool.shape[0]
    return {
        "queries beyond T": (paged_attention, (*b.args()[:4], torch.tensor([0, 2, 4], dtype=torch.int32), b.scale)),
        "more queries than tokens": (paged_attention, (*b.args()[:3], torch.tensor([1, 3], dtype=torch.int32),
                                                       *b.args()[4:])),
        "more tokens than the table holds": (paged_attention, (*b.args()[:3], torch.tensor([5, 17], dtype=torch.int32),
                                                               *b.args()[4:])),
        "block id outside the pool": (paged_attention, (b.q, b.pool, table, *b.args()[3:])),
        "slot outside the pool": (write_kv, (b.pool, torch.zeros(1, 2, 8), torch.zeros(1, 2, 8),
                                             torch.tensor([b.pool.shape[0] * 4]))),
    }


@pytest.mark.parametrize("name", list(_bad_calls()))
def test_bad_arguments_raise_value_error(backend_name: str, name: str) -> None:
    function, args = _bad_calls()[name]
    with pytest.raises(ValueError):
        function(*args)


@pytest.mark.parametrize("name", list(_bad_values()))
def test_kernel_rejects_bad_values(kernel: object, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    use_backend(monkeypatch, "cpp")
    function, args = _bad_values()[name]
    try:
        with pytest.raises(ValueError):
            function(*args)
    finally:
        paged._kernel.cache_clear()


def test_backend_choice(kernel: object, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        use_backend(monkeypatch, "auto")
        assert backend("cpu") == "cpp" and backend("cuda") == "torch"
        use_backend(monkeypatch, "torch")
        assert backend("cpu") == "torch"
        use_backend(monkeypatch, "gpu")
        with pytest.raises(ValueError, match="KVMESH_ATTENTION"):
            backend("cpu")
    finally:
        paged._kernel.cache_clear()


def test_step_attention_over_layers_equals_checked_calls(backend_name: str) -> None:
    """StepAttention checks the first layer's call only; every layer must still write and attend as
    write_kv + paged_attention do, with index tensors laid out the way the runner builds them."""
    from kvmesh.services.engine.native.attention import StepAttention

    layers, n = 3, 20
    batches = [make_batch([40, 23], [n, 1], 4, 2, 64, 16, torch.float32, seed=layer) for layer in range(layers)]
    slots = torch.stack([torch.randperm(batches[0].pool.shape[0] * 16)[:n + 1] for _ in range(layers)], 1).T  # [L, T], strided
    k = torch.randn(n + 1, 2, 64)
    v = torch.randn(n + 1, 2, 64)
    expected_pool, got_pool = batches[0].pool.clone(), batches[0].pool.clone()
    tables = torch.stack([b.block_table for b in batches])
    step = StepAttention(got_pool, tables, slots, batches[0].seq_lens, batches[0].query_start_loc, batches[0].scale)
    for layer, batch in enumerate(batches):
        write_kv(expected_pool, k, v, slots[layer].contiguous())
        expected = paged_attention(batch.q, expected_pool, tables[layer], batch.seq_lens, batch.query_start_loc, batch.scale)
        got = step(layer, batch.q, k, v)
        torch.testing.assert_close(got, expected, equal_nan=True)
    torch.testing.assert_close(got_pool, expected_pool, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_new_prompts_attend_to_themselves_as_through_the_pool(backend_name: str, dtype: torch.dtype) -> None:
    """A step's trailing new prompts (StepAttention's `prompts`) take causal SDPA on this step's k and v;
    the result equals attending through the pool, and their K/V still reaches the pool."""
    from kvmesh.services.engine.native.attention import StepAttention

    # decodes and a chunk after earlier context, then two new prompts (one over a block, one shorter)
    n_qs, new = [1, 1, 20, 37, 9], [(22, 59), (59, 68)]
    seq_lens = [40, 17, 70, 37, 9]
    batch = make_batch(seq_lens, n_qs, 6, 2, 64, 16, dtype)
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(sum(n_qs), 2, 64, generator=gen).to(dtype) for _ in range(2))
    # each new token's slot is its position's slot in its sequence's blocks
    slots = torch.cat([batch.block_table[s, (torch.arange(n - q, n) // 16)].long() * 16 + torch.arange(n - q, n) % 16
                       for s, (n, q) in enumerate(zip(seq_lens, n_qs))])
    tables, layer_slots = batch.block_table[None], slots[None]
    expected_pool, got_pool = batch.pool.clone(), batch.pool.clone()
    through_pool = StepAttention(expected_pool, tables, layer_slots, batch.seq_lens, batch.query_start_loc, batch.scale)
    direct = StepAttention(got_pool, tables, layer_slots, batch.seq_lens, batch.query_start_loc, batch.scale,
                           prompts=new)
    expected, got = through_pool(0, batch.q, k, v), direct(0, batch.q, k, v)
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCE[dtype])
    torch.testing.assert_close(got_pool, expected_pool, equal_nan=True)
    again = direct(0, batch.q, k, v)  # later layers take the unchecked calls
    torch.testing.assert_close(again, got)


def test_new_prompts_and_masked_keys_do_not_mix() -> None:
    from kvmesh.services.engine.native.attention import StepAttention

    batch = make_batch([9], [9], 2, 2, 64, 16, torch.float32)
    valid = torch.ones(batch.pool.shape[0], 16, dtype=torch.bool)
    with pytest.raises(ValueError, match="do not mix"):
        StepAttention(batch.pool, batch.block_table[None], torch.arange(9)[None], batch.seq_lens,
                      batch.query_start_loc, batch.scale, valid=valid, prompts=[(0, 9)])


def test_padding_rows_are_ignored_and_attend_to_nothing(backend_name: str) -> None:
    """Rows the model carries past the step's tokens (fused.padded_rows): their q, k and v are not
    read or written, and their output is zeros; the step's own rows are as without them."""
    from kvmesh.services.engine.native.attention import StepAttention

    n_qs, seq_lens = [1, 20, 9], [40, 70, 9]
    batch = make_batch(seq_lens, n_qs, 4, 2, 64, 16, torch.float32)
    tokens, padding = sum(n_qs), 7
    gen = torch.Generator().manual_seed(2)
    k, v = (torch.randn(tokens + padding, 2, 64, generator=gen) for _ in range(2))
    q = torch.cat([batch.q, torch.full((padding, *batch.q.shape[1:]), math.nan)])
    slots = torch.cat([batch.block_table[s, (torch.arange(n - m, n) // 16)].long() * 16 + torch.arange(n - m, n) % 16
                       for s, (n, m) in enumerate(zip(seq_lens, n_qs))])[None]
    expected_pool, got_pool = batch.pool.clone(), batch.pool.clone()
    expected = StepAttention(expected_pool, batch.block_table[None], slots, batch.seq_lens, batch.query_start_loc,
                             batch.scale)(0, batch.q, k[:tokens], v[:tokens])
    for prompts in ([], [(21, 30)]):
        pool = got_pool.clone()
        step = StepAttention(pool, batch.block_table[None], slots, batch.seq_lens, batch.query_start_loc, batch.scale,
                             prompts=prompts, padding=padding)
        got = step(0, q, k, v)
        assert got.shape == q.shape and not got[tokens:].any()
        torch.testing.assert_close(got[:tokens], expected, **TOLERANCE[torch.float32])
        torch.testing.assert_close(pool, expected_pool, equal_nan=True)
