// A linear layer on GGUF Q4_1 weights for bf16 x, on AVX512-BF16 dot products (VDPBF16PS).
//
// A Q4_1 weight is d * q + m, q a 4-bit integer. So x . w = sum over blocks of d * (q . x) + m * sum(x):
// the block's quants multiply x as they are, and its scale and min apply once to the block's sum.
// A quant (0..15) is exact in bf16, and so is its product with a bf16 x in float32, which is where
// VDPBF16PS sums them. Only the order of float32 sums differs from multiplying the dequantised
// weight; nothing is rounded to bf16 but the output, once, the residual added before.
//
// Weights are laid out for it (quant.py, QuantizedWeight.interleaved): 16 rows side by side, so one
// vector lane holds one output row. Each 32-byte step of a group's block holds, for each of its 16
// rows r, two GGUF bytes (2l, 2l + 1): their low nibbles are weights 2l, 2l + 1 and their high
// nibbles weights 16 + 2l, 16 + 2l + 1, the pairs VDPBF16PS multiplies by x's pairs at those
// positions, broadcast to every lane. Widening the step to 16-bit words and looking each nibble up
// in a table of bf16 values (VPERMW reads 5 bits of the word: the table repeats after 16, so the
// low nibble needs no mask) costs 4 instructions for 64 weights against 2 dot products per row of
// x; the float32 path (quant_linear.cpp) spends about 8 on every 32. On one core of a CPU without
// AMX that is 2.5x fewer instructions at 1 row and 2.4x less time at 4: memory-bound at 1-3 rows,
// then bound by the dot products, as the dense bf16 matmul is (docs/engine.md).

#include "quant_linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_checks.h"
#include "vec.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define KVMESH_BF16_DOTS 1
#endif

namespace kvmesh {
namespace {

constexpr int kRows = 16;  // rows of a group: the lanes of a float32 vector
constexpr int kStepBytes = 32;  // one step of a block: 2 bytes (4 weights) of each row
constexpr int kGroupBlockBytes = kRows * kQuantBlock / 2;  // 256: a group's block, 8 steps
constexpr int kTokens = 4;  // rows of x per pass over a group's weights

#if defined(KVMESH_BF16_DOTS)
// Bytes ahead of the step being read that each step prefetches into L2: a pass reads each group's
// blocks in order, so its weights are one stream; from DRAM this took one thread from ~14 to ~20
// GB/s (the hardware prefetcher alone stays behind), and nearer distances gained less.
constexpr int kPrefetchBytes = 8192;
constexpr int64_t kMinWorkPerThread = 1 << 15;  // ~ cycles: a thread's share must be worth waking it

// Word e holds the bf16 bits of e % 16, for VPERMW.
inline __m512i nibble_values() {
  alignas(64) uint16_t table[32];
  for (int e = 0; e < 32; ++e) {
    const float value = float(e % 16);
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    table[e] = uint16_t(bits >> 16);
  }
  return _mm512_load_si512(table);
}

// x's pair (x[k], x[k + 1]) in every lane.
inline __m512bh pair(const at::BFloat16* x, int64_t k) {
  int32_t bits;
  std::memcpy(&bits, x + k, sizeof bits);
  return (__m512bh)_mm512_set1_epi32(bits);
}

// acc[g][t] = x[t] . W[row] for the 16 rows of each of G groups side by side (G * blocks * 256
// bytes at qs) and TT rows of x (ldx apart); sums[t * blocks + b] is the sum of x[t]'s block b.
template <int G, int TT>
inline void dot_groups(const uint8_t* qs, const float* scales, const float* mins, int64_t blocks,
                       const at::BFloat16* x, int64_t ldx, const float* sums, __m512 (&acc)[G][TT]) {
  const __m512i values = nibble_values();
  const int64_t group_bytes = blocks * kGroupBlockBytes;
  for (int g = 0; g < G; ++g)
    for (int t = 0; t < TT; ++t) acc[g][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    // Low and high nibbles sum apart: two chains of dot products per row of x, not one.
    __m512 low[G][TT], high[G][TT];
    for (int g = 0; g < G; ++g)
      for (int t = 0; t < TT; ++t) low[g][t] = high[g][t] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int l = 0; l < kGroupBlockBytes / kStepBytes; ++l) {
#pragma GCC unroll 2
      for (int g = 0; g < G; ++g) {
        const uint8_t* step = qs + g * group_bytes + b * kGroupBlockBytes + l * kStepBytes;
        if (l % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(step + kPrefetchBytes), _MM_HINT_T1);
        const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(step)));
        const __m512bh w_low = (__m512bh)_mm512_permutexvar_epi16(words, values);
        const __m512bh w_high = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), values);
#pragma GCC unroll 4
        for (int t = 0; t < TT; ++t) {
          const at::BFloat16* xb = x + t * ldx + b * kQuantBlock;
          low[g][t] = _mm512_dpbf16_ps(low[g][t], w_low, pair(xb, 2 * l));
          high[g][t] = _mm512_dpbf16_ps(high[g][t], w_high, pair(xb, kQuantBlock / 2 + 2 * l));
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 d = _mm512_loadu_ps(scales + (g * blocks + b) * kRows);
      const __m512 m = _mm512_loadu_ps(mins + (g * blocks + b) * kRows);
      for (int t = 0; t < TT; ++t) {
        acc[g][t] = _mm512_fmadd_ps(_mm512_add_ps(low[g][t], high[g][t]), d, acc[g][t]);
        acc[g][t] = _mm512_fmadd_ps(m, _mm512_set1_ps(sums[t * blocks + b]), acc[g][t]);
      }
    }
  }
}

// out[t, 16g0 + ...] for G groups from g0 and every row of x, kTokens rows of x per pass.
template <int G>
void linear_groups(const uint8_t* qs, const float* scales, const float* mins, int64_t blocks, int64_t g0, int64_t N,
                   const at::BFloat16* x, int64_t ldx, int64_t tokens, const float* sums,
                   const at::BFloat16* residual, int64_t ldr, at::BFloat16* out) {
  const int64_t offset = g0 * blocks * kRows;
  for (int64_t t0 = 0; t0 < tokens; t0 += kTokens) {
    const auto pass = [&](auto tile) {
      constexpr int TT = decltype(tile)::value;
      __m512 acc[G][TT];
      dot_groups<G, TT>(qs + offset * (kQuantBlock / 2), scales + offset, mins + offset, blocks, x + t0 * ldx, ldx,
                        sums + t0 * blocks, acc);
      for (int g = 0; g < G; ++g) {
        const int64_t n0 = (g0 + g) * kRows;
        const int64_t count = std::min<int64_t>(kRows, N - n0);
        const __mmask16 mask = count == kRows ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
        for (int t = 0; t < TT; ++t) {
          vfloat y = acc[g][t];
          if (residual != nullptr) y += load_first(residual + (t0 + t) * ldr + n0, mask);
          store_first(out + (t0 + t) * N + n0, mask, y);
        }
      }
    };
    with_constant<kTokens>(int(std::min<int64_t>(kTokens, tokens - t0)), pass);
  }
}
#endif

}  // namespace

bool quant_linear_bf16_dots() {
#if defined(KVMESH_BF16_DOTS)
  return true;
#else
  return false;
#endif
}

at::Tensor q4_1_linear_bf16(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                            const at::Tensor& mins, int64_t N, const c10::optional<at::Tensor>& residual) {
  const char* name = "q4_1_linear_bf16";
  TORCH_CHECK_VALUE(quant_linear_bf16_dots(), name, ": the kernels were built for a CPU without AVX512-BF16");
  check_x(x, name);
  TORCH_CHECK_VALUE(x.scalar_type() == at::kBFloat16, name, ": x must be bfloat16, got ", x.scalar_type());
  const int64_t K = x.size(1), blocks = K / kQuantBlock, groups = (N + kRows - 1) / kRows;
  TORCH_CHECK_VALUE(N > 0, name, ": N must be positive, got ", N);
  TORCH_CHECK_VALUE(qs.device().is_cpu() && qs.scalar_type() == at::kByte && qs.dim() == 2 &&
                        qs.size(0) == groups && qs.size(1) == blocks * kGroupBlockBytes && qs.is_contiguous(),
                    name, ": qs must be contiguous uint8 [", groups, ", ", blocks * kGroupBlockBytes,
                    "] (16 rows side by side) on the CPU for N=", N, " and K=", K, ", got ", qs.scalar_type(), " ",
                    qs.sizes());
  check_table(scales, groups, blocks * kRows, "scales", name);
  check_table(mins, groups, blocks * kRows, "mins", name);
  check_residual(x, N, residual, name);
  const int64_t tokens = x.size(0);
  at::Tensor out = at::empty({tokens, N}, x.options());
#if defined(KVMESH_BF16_DOTS)
  if (tokens == 0) return out;
  const at::BFloat16* xs = x.data_ptr<at::BFloat16>();
  const int64_t ldx = x.stride(0);
  std::vector<float> sums(tokens * blocks);  // each block's sum of x, for its min
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t b = 0; b < blocks; ++b) {
      float sum = 0.0f;
      for (int i = 0; i < kQuantBlock; ++i) sum += float(xs[t * ldx + b * kQuantBlock + i]);
      sums[t * blocks + b] = sum;
    }
  const at::BFloat16* res = residual.has_value() ? residual->data_ptr<at::BFloat16>() : nullptr;
  const int64_t ldr = residual.has_value() ? residual->stride(0) : 0;
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const float *d = scales.data_ptr<float>(), *m = mins.data_ptr<float>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  // Groups two at a time: twice the independent chains of dot products.
  const int64_t pairs = (groups + 1) / 2;
  const int64_t work = 2 * blocks * 16 * (2 + tokens);  // ~ cycles per pair
  at::parallel_for(0, pairs, std::max<int64_t>(1, kMinWorkPerThread / work), [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      if (2 * p + 1 < groups) {
        linear_groups<2>(q, d, m, blocks, 2 * p, N, xs, ldx, tokens, sums.data(), res, ldr, o);
      } else {
        linear_groups<1>(q, d, m, blocks, 2 * p, N, xs, ldx, tokens, sums.data(), res, ldr, o);
      }
    }
  });
#endif
  return out;
}

}  // namespace kvmesh
