// Linear layers on GGUF Q4_1 and Q8_0 weights, for decode batches (T of 1 to 64): the weights
// stay in their 4-bit and 8-bit blocks in memory, which is what a memory-bound step pays for.
//
// Each thread takes a range of output rows, R at a time. Each 32-block of those rows is
// dequantised once into registers, exactly (d * q + m in float32: d * q is exact, so the fused
// multiply-add rounds as gguf's two operations do), and multiplied into up to TT rows of x; the
// R * TT sums are float32 vectors along K, reduced together at the end, and each output is rounded
// once to x's dtype, the residual added before. More rows of x reuse a row group's weights,
// dequantised once into a per-thread buffer. x is converted to float32 once per call. With AVX512,
// a Q4_1 block's 16 possible weights d * i + m are one vector that its nibbles index (vpermps
// reads the low 4 bits of each lane, so GGUF's nibble order needs one shift and no mask).
//
// With AMX (built with -march=native on a CPU that has AMX-BF16), bf16 x of kTileRows or more rows
// takes the tile path instead: each group of 16 weight rows is dequantised once, exactly as above, then
// rounded to bf16 (the same bits as the model's dense bf16 weight) and multiplied into every row
// of x by TDPBF16PS, which sums in float32. A decode step then reads the 4-bit weights at any batch
// size instead of the dense bf16 ones: about a quarter of the bytes (see docs/engine.md).
//
// bf16 x on Q4_1 blocks below the tile path's rows has a faster kernel of its own, on a layout of
// its own, where the CPU has AVX512-BF16 (quant_linear_bf16.cpp; quant.py chooses).

#include "quant_linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "quant_checks.h"
#include "vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVMESH_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kvmesh {
namespace {

constexpr int kVecs = kQuantBlock / W;
// Row groups ahead whose bytes each group prefetches: the hardware prefetcher does not follow R
// rows read side by side, and from DRAM this took one thread from ~6 to ~10 GB/s.
constexpr int kPrefetchGroups = 2;
constexpr int64_t kMinWorkPerThread = 1 << 15;  // ~ cycles: a thread's share must be worth waking it

#if defined(__AVX512F__)
static_assert(kVecs == 2, "a block is two AVX512 vectors");
#endif

// The rows of a Q4_1 weight; block(n, b, w) writes block b of row n into w as kVecs vectors.
struct Q4_1Rows {
  const uint8_t* qs;  // [N, blocks * 16]
  const float* scales;  // [N, blocks]
  const float* mins;
  int64_t blocks;  // per row: K / 32
  int64_t rows;  // N

  // Step b of `count` steps through rows [n, n + count): its share of their bytes, into the cache.
  HOT inline void prefetch(int64_t n, int64_t b, int count) const {
    if (n + count > rows) return;
    const int64_t i = n * blocks + b * count;
    for (int line = 0; line < count * (kQuantBlock / 2); line += 64) __builtin_prefetch(qs + i * (kQuantBlock / 2) + line);
    __builtin_prefetch(scales + i);
    __builtin_prefetch(mins + i);
  }

  HOT inline void block(int64_t n, int64_t b, vfloat* w) const {
    const int64_t i = n * blocks + b;
    const uint8_t* q = qs + i * (kQuantBlock / 2);
    const float d = scales[i], m = mins[i];
#if defined(__AVX512F__)
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m512 values = kLaneIndex * d + m;  // the block's 16 possible weights
    w[0] = _mm512_permutexvar_ps(bytes, values);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), values);
#else
    float f[kQuantBlock];
    for (int j = 0; j < kQuantBlock / 2; ++j) {
      f[j] = d * float(q[j] & 0x0F) + m;
      f[j + kQuantBlock / 2] = d * float(q[j] >> 4) + m;
    }
    for (int v = 0; v < kVecs; ++v) w[v] = load(f + v * W);
#endif
  }
};

struct Q8_0Rows {
  const int8_t* qs;  // [N, blocks * 32]
  const float* scales;  // [N, blocks]
  int64_t blocks;
  int64_t rows;

  HOT inline void prefetch(int64_t n, int64_t b, int count) const {
    if (n + count > rows) return;
    const int64_t i = n * blocks + b * count;
    for (int line = 0; line < count * kQuantBlock; line += 64) __builtin_prefetch(qs + i * kQuantBlock + line);
    __builtin_prefetch(scales + i);
  }

  HOT inline void block(int64_t n, int64_t b, vfloat* w) const {
    const int64_t i = n * blocks + b;
    const int8_t* q = qs + i * kQuantBlock;
    const float d = scales[i];
#if defined(__AVX512F__)
    for (int v = 0; v < kVecs; ++v)
      w[v] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + v * W))))
             * d;
#else
    float f[kQuantBlock];
    for (int j = 0; j < kQuantBlock; ++j) f[j] = d * float(q[j]);
    for (int v = 0; v < kVecs; ++v) w[v] = load(f + v * W);
#endif
  }
};

// Rows already dequantised into a buffer: rows [n0, n0 + R) of the weight are rows 0.. R - 1 here.
struct FloatRows {
  const float* w;  // [R, blocks * 32]
  int64_t blocks;

  HOT inline void block(int64_t n, int64_t b, vfloat* out) const {
    for (int v = 0; v < kVecs; ++v) out[v] = load(w + (n * blocks + b) * kQuantBlock + v * W);
  }
  HOT inline void prefetch(int64_t, int64_t, int) const {}  // in L1 already
};

// The sums of N <= 16 vectors' lanes. With AVX512, a vector whose lane i sums v[i]: a tree of
// shuffles and adds that transposes as it sums (45 instructions for 16 vectors, against ~10 per
// vector one by one). Otherwise out[i] = the sum of v[i].
#if defined(__AVX512F__)
template <int N>
HOT inline vfloat sum_lanes(const vfloat* v) {
  static_assert(N >= 1 && N <= 16, "up to 16 vectors");
  __m512 a[16], c[8], e[4];
  for (int j = 0; j < 16; ++j) {  // in transposed order, so that lane i of the result sums v[i]
    const int i = 4 * (j % 4) + j / 4;
    a[j] = i < N ? v[i] : __m512{};
  }
  for (int j = 0; j < 8; ++j)  // 256-bit halves: [a.lo + a.hi | b.lo + b.hi]
    c[j] = _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x44) + _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xEE);
  for (int j = 0; j < 4; ++j)  // 128-bit quarters: each holds 4 partial sums of one vector
    e[j] = _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0x88) + _mm512_shuffle_f32x4(c[2 * j], c[2 * j + 1], 0xDD);
  const __m512 s01 = _mm512_unpacklo_ps(e[0], e[1]) + _mm512_unpackhi_ps(e[0], e[1]);
  const __m512 s23 = _mm512_unpacklo_ps(e[2], e[3]) + _mm512_unpackhi_ps(e[2], e[3]);
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23));
  return _mm512_castpd_ps(lo) + _mm512_castpd_ps(hi);
}
#else
template <int N>
HOT inline void sum_lanes(const vfloat* v, float* out) {
  for (int i = 0; i < N; ++i) {
    float sum = 0.0f;
    for (int lane = 0; lane < W; ++lane) sum += v[i][lane];
    out[i] = sum;
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// out[t, r] = sum of acc[t][r] (+ residual[t, r]) rounded to T, rows of out and residual ldo and
// ldr apart: the R sums of each row of x are one masked store.
template <int R, int TT, typename T>
HOT inline void emit_tile(const vfloat (&acc)[TT][R], const T* residual, int64_t ldr, T* out, int64_t ldo) {
  const vfloat sums = sum_lanes<R * TT>(&acc[0][0]);  // lane t * R + r
  constexpr __mmask16 mask = (1u << R) - 1;
  for (int t = 0; t < TT; ++t) {
    const __m512i lanes = _mm512_add_epi32(_mm512_set1_epi32(t * R),  // row t's sums to lanes 0.. R - 1
                                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    vfloat y = _mm512_permutexvar_ps(lanes, sums);
    if (residual != nullptr) y += load_first(residual + t * ldr, mask);
    store_first(out + t * ldo, mask, y);
  }
}
#else
template <int R, int TT, typename T>
HOT inline void emit_tile(const vfloat (&acc)[TT][R], const T* residual, int64_t ldr, T* out, int64_t ldo) {
#if defined(__AVX512F__)
  float sums[W];
  store(sums, sum_lanes<R * TT>(&acc[0][0]));
#else
  float sums[TT * R];
  sum_lanes<R * TT>(&acc[0][0], sums);
#endif
  for (int t = 0; t < TT; ++t) {
    for (int r = 0; r < R; ++r) {
      float y = sums[t * R + r];
      if (residual != nullptr) y += float(residual[t * ldr + r]);
      out[t * ldo + r] = T(y);
    }
  }
}
#endif

// out[t, r] = x[t] . W[n0 + r] (+ residual[t, r]) for R weight rows and TT rows of x (ldx apart):
// one float32 vector of sums along K per pair, reduced at the end.
template <int R, int TT, typename Rows, typename T>
HOT inline void dot_tile(const Rows& rows, int64_t n0, const float* x, int64_t ldx, const T* residual, int64_t ldr,
                         T* out, int64_t ldo) {
  vfloat acc[TT][R];
  for (int t = 0; t < TT; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = vfloat{};
  for (int64_t b = 0; b < rows.blocks; ++b) {
    rows.prefetch(n0 + kPrefetchGroups * R, b, R);
    vfloat w[R][kVecs];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) rows.block(n0 + r, b, w[r]);
#pragma GCC unroll 16
    for (int t = 0; t < TT; ++t) {
#pragma GCC unroll 4
      for (int v = 0; v < kVecs; ++v) {
        const vfloat xv = load(x + t * ldx + b * kQuantBlock + v * W);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) acc[t][r] += w[r][v] * xv;
      }
    }
  }
  emit_tile<R, TT>(acc, residual, ldr, out, ldo);
}

// out[t, n] = x[t] . W[n] (+ residual[t, n]) for n in [n0, n0 + R) and every t, TT rows of x at
// a time; rows row0.. of `rows` are those weight rows.
template <int R, int TT, typename Rows, typename T>
HOT inline void row_group(const Rows& rows, int64_t n0, int64_t row0, const float* x, int64_t ldx, int64_t tokens,
                          int64_t N, const T* residual, int64_t ldr, T* out) {
  for (int64_t t0 = 0; t0 < tokens; t0 += TT) {
    with_constant<TT>(int(std::min<int64_t>(TT, tokens - t0)), [&](auto tile) {
      constexpr int tt = decltype(tile)::value;
      dot_tile<R, tt>(rows, row0, x + t0 * ldx, ldx, residual == nullptr ? nullptr : residual + t0 * ldr + n0, ldr,
                      out + t0 * N + n0, N);
    });
  }
}

// Rows [n0, n0 + count) of the weight as float32, into out [count, K].
template <typename Rows>
void dequantize_rows(const Rows rows, int64_t n0, int count, float* __restrict out) {
  for (int64_t b = 0; b < rows.blocks; ++b) {
    rows.prefetch(n0 + kPrefetchGroups * count, b, count);
    for (int r = 0; r < count; ++r) {
      vfloat w[kVecs];
      rows.block(n0 + r, b, w);
      for (int v = 0; v < kVecs; ++v) store(out + (r * rows.blocks + b) * kQuantBlock + v * W, w[v]);
    }
  }
}

// Tile shapes, measured on Sapphire Rapids: R weight rows by TT rows of x make R * TT
// accumulators (with R * kVecs weight vectors, within AVX512's 32 registers). One row of x takes
// 8 weight rows at a time (enough independent sums to hide the FMA latency); up to kFusedTokens
// rows, 4 by 4, each block dequantised in registers; beyond, each group of 4 weight rows is
// dequantised into a per-thread buffer once and read back for every 4 rows of x.
constexpr int64_t kFusedTokens = 4;

template <int R, int TT, bool kBuffered, typename Rows, typename T>
void linear_rows(const Rows& rows, const float* x, int64_t ldx, int64_t tokens, int64_t N, const T* residual,
                 int64_t ldr, T* out) {
  const int64_t groups = (N + R - 1) / R;
  const int64_t work = R * std::max<int64_t>(rows.blocks, 1) * (tokens + 4);  // ~ cycles per group
  at::parallel_for(0, groups, std::max<int64_t>(1, kMinWorkPerThread / work), [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(kBuffered ? R * rows.blocks * kQuantBlock : 0);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * R;
      with_constant<R>(int(std::min<int64_t>(R, N - n0)), [&](auto group) {
        constexpr int r = decltype(group)::value;
        if constexpr (kBuffered) {
          dequantize_rows(rows, n0, r, buffer.data());
          row_group<r, TT>(FloatRows{buffer.data(), rows.blocks}, n0, 0, x, ldx, tokens, N, residual, ldr, out);
        } else {
          row_group<r, TT>(rows, n0, n0, x, ldx, tokens, N, residual, ldr, out);
        }
      });
    }
  });
}

template <typename Rows, typename T>
void quant_linear_rows(const Rows& rows, const float* x, int64_t ldx, int64_t tokens, int64_t N, const T* residual,
                       int64_t ldr, T* out) {
  if (tokens == 1) {
    linear_rows<8, 1, false>(rows, x, ldx, tokens, N, residual, ldr, out);
  } else if (tokens <= kFusedTokens) {
    linear_rows<4, kFusedTokens, false>(rows, x, ldx, tokens, N, residual, ldr, out);
  } else {
    linear_rows<4, 4, true>(rows, x, ldx, tokens, N, residual, ldr, out);
  }
}

#if defined(KVMESH_AMX)
constexpr int kTile = 16;  // rows of every tile; columns (tokens) of x's tiles and the sums'
constexpr int kSumTiles = 4;  // tokens per pass: kSumTiles * kTile (tiles 2..5 hold their sums)
// Up to kFusedTokens rows the vector path dequantises each block in registers, once for all rows,
// and beats the tiles (30 layers of SmolLM2's shapes, 2 threads: 4.8-6.0 ms at 2-4 rows against
// 9.2-10.4); from the next row on it dequantises into a buffer and the tiles win (9.3 ms at 6
// rows against 12.2).
constexpr int64_t kTileRows = kFusedTokens + 1;

// Linux gives a process AMX's tile registers only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM).
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// x's rows as TDPBF16PS's second operand: for K chunk c and tile u of 16 tokens, 16 rows p of
// the pairs (x[t, 32c + 2p], x[t, 32c + 2p + 1]) of the tile's tokens t, zeros past the last.
void pack_token_pairs(const at::BFloat16* x, int64_t ldx, int64_t tokens, int64_t chunks, uint32_t* out) {
  const int64_t tiles = (tokens + kTile - 1) / kTile;
  std::fill(out, out + chunks * tiles * kTile * kTile, 0u);
  for (int64_t t = 0; t < tokens; ++t) {
    const at::BFloat16* row = x + t * ldx;
    for (int64_t c = 0; c < chunks; ++c) {
      uint32_t* tile = out + (c * tiles + t / kTile) * kTile * kTile + t % kTile;
      for (int p = 0; p < kTile; ++p) std::memcpy(tile + p * kTile, row + c * kQuantBlock + 2 * p, sizeof(uint32_t));
    }
  }
}

// Chunk b (one block along K) of rows [n0, n0 + count) of the weight, dequantised and rounded to
// bf16, as TDPBF16PS's first operand: 16 rows of 32 weights at out.
template <typename Rows>
HOT inline void dequantize_chunk(const Rows& rows, int64_t n0, int count, int64_t b, at::BFloat16* out) {
  rows.prefetch(n0 + kPrefetchGroups * kTile, b, kTile);
  for (int r = 0; r < count; ++r) {
    vfloat w[kVecs];
    rows.block(n0 + r, b, w);
    // Rounds to nearest even as store_float does; it would flush denormals, which weights of fp16
    // scales times small integers cannot be.
    _mm512_storeu_si512(out + r * kQuantBlock, (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]));
  }
}

// The sums of tile u (float32 [16 weight rows][16 tokens]) plus the residual, rounded to bf16,
// into out[t, n0 + r] for the tile's tokens.
HOT inline void emit_sums(const float* sums, int64_t t0, int64_t tokens, int64_t n0, int count,
                          const at::BFloat16* residual, int64_t ldr, at::BFloat16* out, int64_t N) {
  const __m512i column = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
  const __mmask16 mask = count == kTile ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
  for (int64_t t = t0; t < std::min<int64_t>(t0 + kTile, tokens); ++t) {  // token t's sums: column t - t0
    vfloat y = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, column, sums + (t - t0), sizeof(float));
    if (residual != nullptr) y += load_first(residual + t * ldr + n0, mask);
    store_first(out + t * N + n0, mask, y);
  }
}

// GCC's tile intrinsics paste their tile numbers into the instruction's text: literals only.
// Tile 0 holds the weights, 1 the tokens' pairs, 2.. 5 (sum tiles 0.. 3) the float32 sums.
HOT inline void multiply_into(int sum_tile, const uint32_t* pairs) {
  _tile_loadd(1, pairs, kTile * sizeof(uint32_t));
  switch (sum_tile) {
    case 0: _tile_dpbf16ps(2, 0, 1); break;
    case 1: _tile_dpbf16ps(3, 0, 1); break;
    case 2: _tile_dpbf16ps(4, 0, 1); break;
    default: _tile_dpbf16ps(5, 0, 1); break;
  }
}

HOT inline void store_sums(int sum_tile, float* out) {
  switch (sum_tile) {
    case 0: _tile_stored(2, out, kTile * sizeof(float)); break;
    case 1: _tile_stored(3, out, kTile * sizeof(float)); break;
    case 2: _tile_stored(4, out, kTile * sizeof(float)); break;
    default: _tile_stored(5, out, kTile * sizeof(float)); break;
  }
}

template <typename Rows>
void amx_linear(const Rows& rows, const at::BFloat16* x, int64_t ldx, int64_t tokens, int64_t N,
                const at::BFloat16* residual, int64_t ldr, at::BFloat16* out) {
  const int64_t chunks = rows.blocks, tiles = (tokens + kTile - 1) / kTile;
  std::vector<uint32_t> pairs(chunks * tiles * kTile * kTile);
  pack_token_pairs(x, ldx, tokens, chunks, pairs.data());
  const int64_t groups = (N + kTile - 1) / kTile;
  const int64_t work = kTile * chunks * (16 + tiles * 4);  // ~ cycles per group
  at::parallel_for(0, groups, std::max<int64_t>(1, kMinWorkPerThread / work), [&](int64_t begin, int64_t end) {
    TileConfig config;
    for (int i = 0; i < 2 + kSumTiles; ++i) config.rows[i] = kTile, config.colsb[i] = 64;
    _tile_loadconfig(&config);
    std::vector<at::BFloat16> weights(chunks * kTile * kQuantBlock);
    alignas(64) float sums[kTile * kTile], more[kTile * kTile];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kTile;
      const int count = int(std::min<int64_t>(kTile, N - n0));
      if (count < kTile) std::fill(weights.begin(), weights.end(), at::BFloat16(0.0f));  // rows past N
      for (int64_t u0 = 0; u0 < tiles; u0 += kSumTiles) {
        // Each tile of tokens sums into `lanes` tiles, chunk c into lane c % lanes: one
        // accumulator would chain every TDPBF16PS on the one before it.
        const int n = int(std::min<int64_t>(kSumTiles, tiles - u0)), lanes = kSumTiles / n;
        const auto multiply = [&](int64_t c) {
          _tile_loadd(0, weights.data() + c * kTile * kQuantBlock, kQuantBlock * sizeof(at::BFloat16));
          const uint32_t* tile = pairs.data() + (c * tiles + u0) * kTile * kTile;
          for (int u = 0; u < n; ++u) multiply_into(u * lanes + int(c % lanes), tile + u * kTile * kTile);
        };
        _tile_zero(2);
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        if (u0 == 0) {  // the first pass dequantises as it goes, a chunk ahead: the tile unit and the
                        // vector units then work side by side
          for (int64_t c = 0; c < chunks; ++c) {
            dequantize_chunk(rows, n0, count, c, weights.data() + c * kTile * kQuantBlock);
            if (c > 0) multiply(c - 1);
          }
          multiply(chunks - 1);
        } else {
          for (int64_t c = 0; c < chunks; ++c) multiply(c);
        }
        for (int u = 0; u < n; ++u) {
          store_sums(u * lanes, sums);
          for (int lane = 1; lane < lanes; ++lane) {
            store_sums(u * lanes + lane, more);
            for (int i = 0; i < kTile * kTile; i += W) store(sums + i, load(sums + i) + load(more + i));
          }
          emit_sums(sums, (u0 + u) * kTile, tokens, n0, count, residual, ldr, out, N);
        }
      }
    }
    _tile_release();
  });
}
#endif

HOT inline void widen(const at::BFloat16* in, float* out, int64_t n) {  // n a multiple of W
  for (int64_t i = 0; i < n; i += W) store(out + i, load_float(in + i));
}

// x @ W^T (+ residual) for the weight's rows: [T, N] in x's dtype.
template <typename Rows>
at::Tensor run(const at::Tensor& x, const Rows& rows, int64_t N, const c10::optional<at::Tensor>& residual) {
  const int64_t tokens = x.size(0), K = x.size(1);
  at::Tensor out = at::empty({tokens, N}, x.options());
  if (out.numel() == 0) return out;
  const auto go = [&](auto tag) {
    using T = decltype(tag);
    const T* res = residual.has_value() ? residual->data_ptr<T>() : nullptr;
    const int64_t ldr = residual.has_value() ? residual->stride(0) : 0;
    if constexpr (std::is_same_v<T, float>) {
      quant_linear_rows(rows, x.data_ptr<float>(), x.stride(0), tokens, N, res, ldr, out.data_ptr<T>());
    } else {
#if defined(KVMESH_AMX)
      if (tokens >= kTileRows && amx_permitted()) {
        amx_linear(rows, x.data_ptr<T>(), x.stride(0), tokens, N, res, ldr, out.data_ptr<T>());
        return;
      }
#endif
      thread_local std::vector<float> xf;  // x as float32, kept for the next call
      xf.resize(tokens * K);
      for (int64_t t = 0; t < tokens; ++t) widen(x.data_ptr<T>() + t * x.stride(0), xf.data() + t * K, K);
      quant_linear_rows(rows, xf.data(), K, tokens, N, res, ldr, out.data_ptr<T>());
    }
  };
  if (x.scalar_type() == at::kFloat) {
    go(float{});
  } else {
    go(at::BFloat16{});
  }
  return out;
}

}  // namespace

int64_t quant_linear_tile_rows() {
#if defined(KVMESH_AMX)
  return amx_permitted() ? kTileRows : 0;
#else
  return 0;
#endif
}

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales, const at::Tensor& mins,
                       const c10::optional<at::Tensor>& residual) {
  const char* name = "q4_1_linear";
  check_x(x, name);
  const int64_t K = x.size(1), blocks = K / kQuantBlock, N = qs.dim() == 2 ? qs.size(0) : 0;
  TORCH_CHECK_VALUE(qs.device().is_cpu() && qs.scalar_type() == at::kByte && qs.dim() == 2 && qs.size(1) == K / 2 &&
                        qs.is_contiguous(),
                    name, ": qs must be contiguous uint8 [N, ", K / 2, "] on the CPU for K=", K, ", got ",
                    qs.scalar_type(), " ", qs.sizes());
  check_table(scales, N, blocks, "scales", name);
  check_table(mins, N, blocks, "mins", name);
  check_residual(x, N, residual, name);
  return run(x, Q4_1Rows{qs.data_ptr<uint8_t>(), scales.data_ptr<float>(), mins.data_ptr<float>(), blocks, N}, N,
             residual);
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& residual) {
  const char* name = "q8_0_linear";
  check_x(x, name);
  const int64_t K = x.size(1), blocks = K / kQuantBlock, N = qs.dim() == 2 ? qs.size(0) : 0;
  TORCH_CHECK_VALUE(qs.device().is_cpu() && qs.scalar_type() == at::kChar && qs.dim() == 2 && qs.size(1) == K &&
                        qs.is_contiguous(),
                    name, ": qs must be contiguous int8 [N, ", K, "] on the CPU for K=", K, ", got ",
                    qs.scalar_type(), " ", qs.sizes());
  check_table(scales, N, blocks, "scales", name);
  check_residual(x, N, residual, name);
  return run(x, Q8_0Rows{qs.data_ptr<int8_t>(), scales.data_ptr<float>(), blocks, N}, N, residual);
}

}  // namespace kvmesh
