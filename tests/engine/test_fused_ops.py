"""The fused layer steps (attention/fused.py): the C++ pass of each against the torch ops it replaces."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from kvmesh.services.engine.native.attention import fused, paged
from kvmesh.services.engine.native.models.rope import apply_rotary

from .test_paged_attention import kernel, use_backend  # noqa: F401 - the fixture builds the kernel

DTYPES = [torch.float32, torch.bfloat16]
# exp's own rounding (SiLU) may move a bf16 result by one unit in the last place
ULP = {torch.float32: {"atol": 1e-6, "rtol": 1e-6}, torch.bfloat16: {"atol": 1e-2, "rtol": 1e-2}}


@pytest.fixture
def cpp(kernel: object, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:  # noqa: F811
    use_backend(monkeypatch, "cpp")
    yield
    paged._kernel.cache_clear()


def torch_path(fn, *args, **kwargs):
    """fn as the plain-torch path computes it (KVMESH_ATTENTION=torch)."""
    paged._kernel.cache_clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVMESH_ATTENTION", "torch")
        try:
            return fn(*args, **kwargs)
        finally:
            paged._kernel.cache_clear()


def randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 256), (16, 256), (7, 33), (3, 4096)])
def test_rms_norm_matches_torch(cpp: None, dtype: torch.dtype, tokens: int, hidden: int) -> None:
    x, weight = randn(tokens, hidden, dtype=dtype), randn(hidden, dtype=dtype, seed=1)
    expected = weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    torch.testing.assert_close(fused.rms_norm(x, weight, 1e-5), expected, **ULP[dtype])
    torch.testing.assert_close(torch_path(fused.rms_norm, x, weight, 1e-5), expected, **ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "head_dim"), [(4, 2, 64), (8, 2, 128), (2, 2, 32), (3, 1, 40), (4, 1, 6)])
def test_rotary_on_a_qkv_view_equals_apply_rotary(cpp: None, dtype: torch.dtype, hq: int, hkv: int,
                                                  head_dim: int) -> None:
    tokens = 11
    qkv = randn(tokens, (hq + 2 * hkv) * head_dim, dtype=dtype)
    qk = qkv[:, :(hq + hkv) * head_dim].view(tokens, -1, head_dim)  # strided tokens, as in the model
    cos, sin = randn(2, tokens, 1, head_dim, dtype=dtype, seed=1)
    out = fused.rotary(qk, cos, sin)
    assert out.is_contiguous()
    # bf16: the same roundings as the torch ops, so the same bits; float32 may fuse a multiply-add
    exact = {"atol": 0, "rtol": 0} if dtype == torch.bfloat16 else ULP[dtype]
    torch.testing.assert_close(out, apply_rotary(qk, cos, sin), **exact)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "intermediate"), [(1, 688), (16, 688), (5, 37)])
def test_silu_mul_matches_torch(cpp: None, dtype: torch.dtype, tokens: int, intermediate: int) -> None:
    gate_up = randn(tokens, 2 * intermediate, dtype=dtype) * 4
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(fused.silu_mul(gate_up), F.silu(gate) * up, **ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 16, 33, 300])
def test_linear_with_bias_or_residual_matches_torch(cpp: None, dtype: torch.dtype, tokens: int) -> None:
    x, weight = randn(tokens, 96, dtype=dtype), randn(80, 96, dtype=dtype, seed=1)
    bias, residual = randn(80, dtype=dtype, seed=2), randn(tokens, 80, dtype=dtype, seed=3)
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0, "rtol": 0}
    torch.testing.assert_close(fused.linear(x, weight), F.linear(x, weight), **tolerance)
    torch.testing.assert_close(fused.linear(x, weight, bias), F.linear(x, weight, bias), **tolerance)
    torch.testing.assert_close(fused.linear(x, weight, residual=residual), torch.addmm(residual, x, weight.t()),
                               **tolerance)


def test_linear_repacks_a_weight_changed_in_place(cpp: None) -> None:
    x, weight = randn(4, 64, dtype=torch.bfloat16), randn(32, 64, dtype=torch.bfloat16, seed=1)
    fused.linear(x, weight)
    weight.mul_(2)
    torch.testing.assert_close(fused.linear(x, weight), F.linear(x, weight), atol=0, rtol=0)


def test_kernels_reject_bad_arguments(cpp: None) -> None:
    x = randn(4, 8, dtype=torch.float32)
    with pytest.raises(ValueError):
        fused.rms_norm(x, randn(7, dtype=torch.float32), 1e-5)
    with pytest.raises(ValueError):
        fused.rms_norm(x.half(), randn(8, dtype=torch.float32).half(), 1e-5)
    with pytest.raises(ValueError):
        fused.rotary(x.view(4, 1, 8), randn(4, 1, 6, dtype=torch.float32), randn(4, 1, 6, dtype=torch.float32))
    with pytest.raises(ValueError):
        fused.silu_mul(randn(4, 7, dtype=torch.float32))
