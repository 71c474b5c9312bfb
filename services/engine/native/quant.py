"""Linear weights kept in GGUF's Q4_1 and Q8_0 blocks, multiplied without dequantising them in memory.

Decode at small batch is memory-bound: a Q4_1 weight reads 0.75 bytes per parameter (Q8_0: 1.125)
where bf16 reads 2. On CPU the C++ kernels (attention/csrc/quant_linear.cpp) read the blocks as
they are; anywhere else, or with KVMESH_ATTENTION=torch, the weight is dequantised and goes through
F.linear.

GGUF stores a [N, K] tensor as N * K / 32 blocks, row by row, each block 32 consecutive weights of
one row (along K):
  Q4_1, 20 bytes: d (float16), m (float16), qs[16]; weight j = d * q_j + m, q_j the low nibble of
                  qs[j] for j < 16 and the high nibble of qs[j - 16] otherwise.
  Q8_0, 34 bytes: d (float16), qs[32] int8; weight j = d * qs[j].
A QuantizedWeight holds them split by field: qs (the nibbles or int8s in GGUF's order, [N, K / 2]
uint8 or [N, K] int8), scales (d) and, for Q4_1, mins (m) as float32 [N, K / 32]. float32 scales
make d * q + m exact in float32 (d * q is), so the kernel and dequantize() agree with gguf's own
dequantisation to the bit.

bf16 x on a CPU with AVX512-BF16 takes its own kernel for Q4_1 (csrc/quant_linear_bf16.cpp): it sums
quants times x on bf16 dot products and applies d and m once a block, reading the weight laid out 16
rows side by side (`QuantizedWeight.interleaved`, built on first use). On AMX, from `tile_rows` rows
the tile path takes over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention.paged import _kernel

BLOCK = 32  # weights per block, along K
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def tile_rows(device: torch.device | str) -> int:
    """The fewest rows of bf16 x multiplied on AMX tiles here (csrc/quant_linear.cpp: the blocks
    dequantised and rounded to bf16, the same bits as the dense bf16 weights, then summed in
    float32), 0 where there are no tiles; fewer rows, and float32 x, take the float32-vector path."""
    kernel = _kernel() if torch.device(device).type == "cpu" else None
    return kernel.quant_linear_tile_rows() if kernel is not None else 0


def tile_path(device: torch.device | str) -> bool:
    """Whether bf16 x of tile_rows or more rows is multiplied on AMX tiles here."""
    return tile_rows(device) > 0


def bf16_dots(device: torch.device | str) -> bool:
    """Whether bf16 x multiplies Q4_1 weights on bf16 dot products here (csrc/quant_linear_bf16.cpp),
    below tile_rows rows where there are AMX tiles, at any number of rows elsewhere."""
    kernel = _kernel() if torch.device(device).type == "cpu" else None
    return kernel is not None and _bf16_dot_rows(kernel) > 0


@cache
def _bf16_dot_rows(kernel: Any) -> int:
    """Fewer rows of bf16 x than this take the bf16-dot kernel: up to the tile path's first, any
    number without AMX, none where the kernels were built without AVX512-BF16."""
    if not kernel.quant_linear_bf16_dots():
        return 0
    return kernel.quant_linear_tile_rows() or 2**62


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """One [N, K] linear weight in Q4_1 or Q8_0 blocks (layout in the module docstring)."""

    kind: str
    qs: Tensor
    scales: Tensor
    mins: Tensor | None = None
    _shape: tuple[int, int] = field(init=False, repr=False)
    _on_cpu: bool = field(init=False, repr=False)
    _interleaved: tuple[Tensor, Tensor, Tensor] | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_BYTES:
            raise ValueError(f"QuantizedWeight: kind must be one of {', '.join(BLOCK_BYTES)}, got {self.kind!r}")
        q_dtype, per_block = (torch.uint8, BLOCK // 2) if self.kind == "q4_1" else (torch.int8, BLOCK)
        if self.qs.dtype != q_dtype or self.qs.dim() != 2 or self.qs.shape[1] % per_block:
            raise ValueError(f"QuantizedWeight({self.kind}): qs must be {q_dtype} [N, a multiple of {per_block}], "
                             f"got {self.qs.dtype} {tuple(self.qs.shape)}")
        tables = [self.scales] + ([self.mins] if self.kind == "q4_1" else [])
        if self.kind == "q8_0" and self.mins is not None:
            raise ValueError("QuantizedWeight(q8_0): Q8_0 blocks have no mins")
        blocks = (self.qs.shape[0], self.qs.shape[1] // per_block)
        for table in tables:
            if table is None or table.dtype != torch.float32 or tuple(table.shape) != blocks:
                raise ValueError(f"QuantizedWeight({self.kind}): scales and mins must be float32 {blocks}, got "
                                 f"{None if table is None else (table.dtype, tuple(table.shape))}")
        n, width = self.qs.shape
        object.__setattr__(self, "_shape", (n, width * 2 if self.kind == "q4_1" else width))
        object.__setattr__(self, "_on_cpu", self.qs.is_cpu)

    @classmethod
    def from_gguf_blocks(cls, kind: str, raw: Any, shape: tuple[int, int]) -> QuantizedWeight:
        """The weight of shape (N, K) from its GGUF block bytes (numpy uint8, e.g. GGUFReader's tensor.data)."""
        import numpy as np

        if kind not in BLOCK_BYTES:
            raise ValueError(f"from_gguf_blocks: kind must be one of {', '.join(BLOCK_BYTES)}, got {kind!r}")
        n, k = shape
        if n < 0 or k < 0 or k % BLOCK:
            raise ValueError(f"from_gguf_blocks: shape must be (N, K) with K a multiple of {BLOCK}, got {shape}")
        raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
        if not raw.flags.writeable:  # GGUFReader's read-only memory map; torch wants to own a copy
            raw = raw.copy()
        size = BLOCK_BYTES[kind]
        if raw.size != n * (k // BLOCK) * size:
            raise ValueError(f"from_gguf_blocks: {kind} {shape} is {n * (k // BLOCK) * size} bytes, got {raw.size}")
        blocks = torch.from_numpy(raw).view(n * (k // BLOCK), size)
        scales = _halves(blocks[:, 0:2]).view(n, k // BLOCK)
        if kind == "q4_1":
            return cls(kind, blocks[:, 4:].reshape(n, k // 2), scales, _halves(blocks[:, 2:4]).view(n, k // BLOCK))
        return cls(kind, blocks[:, 2:].reshape(n, k).view(torch.int8), scales)

    @classmethod
    def cat(cls, weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """The weights stacked along N (rows), e.g. q, k and v into one qkv projection."""
        if not weights:
            raise ValueError("QuantizedWeight.cat: no weights")
        first = weights[0]
        for w in weights[1:]:
            if w.kind != first.kind or w.shape[1] != first.shape[1]:
                raise ValueError(f"QuantizedWeight.cat: weights must share kind and K, got {first.kind} "
                                 f"{first.shape} and {w.kind} {w.shape}")
        mins = torch.cat([w.mins for w in weights]) if first.mins is not None else None  # type: ignore[misc]
        return cls(first.kind, torch.cat([w.qs for w in weights]), torch.cat([w.scales for w in weights]), mins)

    def take_rows(self, index: Tensor | Sequence[int]) -> QuantizedWeight:
        """Rows index[0], index[1], ... of this weight (e.g. llama.cpp's Q/K rows put back in order)."""
        index = torch.as_tensor(index, dtype=torch.int64, device=self.qs.device)
        if index.dim() != 1:
            raise ValueError(f"take_rows: index must be 1-D, got shape {tuple(index.shape)}")
        mins = self.mins[index] if self.mins is not None else None
        return QuantizedWeight(self.kind, self.qs[index], self.scales[index], mins)

    @property
    def shape(self) -> tuple[int, int]:
        return self._shape

    @property
    def device(self) -> torch.device:
        return self.qs.device

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads per call: the whole weight."""
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins) if t is not None)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        mins = self.mins.to(device) if self.mins is not None else None
        return QuantizedWeight(self.kind, self.qs.to(device), self.scales.to(device), mins)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The weight [N, K] as gguf dequantises it (float32), then cast to dtype."""
        n, k = self.shape
        if self.kind == "q4_1":
            packed = self.qs.view(n, k // BLOCK, BLOCK // 2)
            q = torch.cat((packed & 0x0F, packed >> 4), dim=2).float()
            w = q * self.scales.unsqueeze(2) + self.mins.unsqueeze(2)  # type: ignore[union-attr]
        else:
            w = self.qs.view(n, k // BLOCK, BLOCK).float() * self.scales.unsqueeze(2)
        return w.view(n, k).to(dtype)

    def linear(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        """x [T, K] @ W^T (+ residual [T, N]), in x's dtype. On CPU, for float32 or bf16 x, the C++
        kernel sums in float32 and rounds each output once, the residual added first; anything else
        takes the torch fallback. The kernel checks its inputs itself: this runs a few times per layer
        and step, and checks here too would cost a tenth of a small layer's time."""
        kernel = _kernel() if self._on_cpu and x.is_cpu else None
        if kernel is not None:
            try:
                return self._kernel_linear(kernel, x, residual)
            except ValueError:
                self._check(x, residual)  # say what is wrong in this weight's terms, or run where it fits
                if x.dtype in KERNEL_DTYPES:
                    residual = None if residual is None else residual.contiguous()
                    return self._kernel_linear(kernel, x.contiguous(), residual)
        self._check(x, residual)
        return torch_linear(self, x, residual)

    def interleaved(self) -> tuple[Tensor, Tensor, Tensor]:
        """This Q4_1 weight as q4_1_linear_bf16 reads it (csrc/quant_linear.h): qs, scales and mins of
        16 rows side by side, rows past N zeros. Built on first use and kept; the GGUF layout stays
        for the other paths."""
        if self._interleaved is None:
            if self.mins is None:
                raise ValueError("QuantizedWeight.interleaved: Q4_1 weights only")
            n, k = self.shape
            blocks, groups = k // BLOCK, -(-n // 16)
            rows = (0, 0, 0, groups * 16 - n)  # F.pad: zero rows at the end

            def side_by_side(table: Tensor) -> Tensor:
                return F.pad(table, rows).view(groups, 16, blocks).transpose(1, 2).reshape(groups, blocks * 16)

            # byte 2r + p of step l of a group's block: byte 2l + p of row r's block
            qs = F.pad(self.qs, rows).view(groups, 16, blocks, 8, 2).permute(0, 2, 3, 1, 4)
            object.__setattr__(self, "_interleaved", (qs.reshape(groups, blocks * 256).contiguous(),
                                                      side_by_side(self.scales), side_by_side(self.mins)))
        return self._interleaved  # type: ignore[return-value]

    def _kernel_linear(self, kernel: Any, x: Tensor, residual: Tensor | None) -> Tensor:
        if self.mins is not None:
            if x.dtype == torch.bfloat16 and x.shape[0] < _bf16_dot_rows(kernel):
                return kernel.q4_1_linear_bf16(x, *self.interleaved(), self._shape[0], residual)
            return kernel.q4_1_linear(x, self.qs, self.scales, self.mins, residual)
        return kernel.q8_0_linear(x, self.qs, self.scales, residual)

    def _check(self, x: Tensor, residual: Tensor | None) -> None:
        n, k = self.shape
        if x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"QuantizedWeight.linear: x must be [T, {k}], got {tuple(x.shape)}")
        if residual is not None and tuple(residual.shape) != (x.shape[0], n):
            raise ValueError(f"QuantizedWeight.linear: residual must be [{x.shape[0]}, {n}], got "
                             f"{tuple(residual.shape)}")

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.kind}, shape={self.shape}, device={self.device})"


def torch_linear(weight: QuantizedWeight, x: Tensor, residual: Tensor | None = None) -> Tensor:
    """The plain-torch path of QuantizedWeight.linear, on any device: F.linear on the dequantised weight."""
    y = F.linear(x, weight.dequantize(x.dtype))
    return y if residual is None else y + residual


def _halves(pairs: Tensor) -> Tensor:
    """float16 values from their two little-endian bytes each ([M, 2] uint8), as float32 [M]."""
    return pairs.contiguous().view(torch.float16).view(-1).float()
