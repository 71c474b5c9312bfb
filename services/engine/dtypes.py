"""Which dtype a device computes fastest: bfloat16 where it is native (a GPU; a CPU with AVX512 BW/VL/DQ
or AVX-NE-CONVERT, which oneDNN's bf16 kernels need), float32 elsewhere. On a CPU without them
torch emulates bf16: a 1024 x 512 by 512 x 1408 matmul took 163 ms against float32's 23 ms on an
AVX2-only machine."""

from __future__ import annotations

import functools

import torch


@functools.cache
def bf16_native(device: str = "cpu") -> bool:
    if torch.device(device).type == "cuda":
        return True
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def fastest_dtype(device: str = "cpu") -> str:
    """The engine's `dtype` setting that computes fastest on `device`."""
    return "bfloat16" if bf16_native(device) else "float32"
