// Paged attention on CPU over the KV pool, reading K/V blocks in place (layout: docs/engine.md).
//
// A work item is one sequence's tile of queries against one KV head (prefill), or against all
// its KV heads (decode: few queries, so each block is read front to back once). Its rows are
// (query, query head) pairs, so each K/V block loaded serves all of them, GQA included. Each row
// keeps a flash-style online softmax (running max m, sum l, accumulator acc) in float32. Two
// layouts of the scores:
//  - few rows (decodes): keys in tiles of up to kKeyTile across blocks; per row, a dot product
//    per key vectorised along head_dim, W of them reduced at once (transpose_sum), then p.V with
//    each V row loaded once for all the rows of its KV head. With AVX512-BF16, bf16 q.k and p.V
//    run on its pairwise dot product (p rounded to bf16, as a bf16 matmul would); otherwise bf16
//    is widened in registers;
//  - many rows (prefill tiles): rows in vector lanes, so no horizontal sums at all; bf16 blocks
//    (and head_dims that are not whole pairs of vectors) are widened into a per-thread buffer,
//    once per block for all rows.
// An optional mask (valid, one bool per pool slot) drops keys: their scores become -inf before the
// softmax, so they get probability 0 (their K/V rows must be finite, as 0 * V must be 0).
// Items are handed out to at::parallel_for's threads dynamically, largest first. While a thread
// works on one few-rows item, it brings the next one's blocks into its L2 a few lines at a time
// (Scratch::Ahead): a decode's K/V is read once and only a few KB a block, so without that the
// compute and the reads take turns (16 decodes of 290 keys, one thread: 6.2 GB/s against 8.4 with it).
// Needs GCC >= 12 or Clang (vector extensions with __builtin_shufflevector), little-endian.
#include <torch/extension.h>

#include "block_copy.h"
#include "layer_ops.h"
#include "quant_linear.h"
#include "vec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using namespace kvmesh;

constexpr int kMaxRowVecs = 4;  // a prefill tile has up to kMaxRowVecs * W rows
// Keys ahead whose K and V rows the few-rows path prefetches (see prefetch_keys).
constexpr int64_t kPrefetchKeys = 64;
// Software prefetches go to L2 (prefetcht2), not L1: a tile's K and V rows (196 KB at 256 keys and
// 384 bytes a key) do not fit L1, and prefetches into L1 held its fill buffers (20% slower).
constexpr int kPrefetchLocality = 1;
constexpr int64_t kMinCostPerThread = 4096;  // (query row, key) pairs, a few microseconds of work
constexpr int64_t kMaxPosition = 1 << 24;  // positions are compared as floats, exact up to here
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// C vectors of a row read in place. For bf16 (float = bf16 bits << 16), 2W elements load as W
// 32-bit words whose low halves are the even elements and high halves the odd ones, so one load
// and two bit operations give [evens, odds]: rows read this way (q and acc too) are in "pair
// order", 2W elements at a time, which dot products and sums of rows do not care about.
template <int C>
HOT inline void load_row(const float* p, vfloat* out) {
  for (int c = 0; c < C; ++c) out[c] = load(p + c * W);
}
template <int C>
HOT inline void load_row(const at::BFloat16* p, vfloat* out) {
  static_assert(C % 2 == 0, "bf16 rows load in pairs of vectors");
  for (int c = 0; c < C; c += 2) {
    vint words;
    std::memcpy(&words, p + c * W, sizeof words);
    out[c] = reinterpret_cast<vfloat>(words << 16);
    out[c + 1] = reinterpret_cast<vfloat>(words & vint{} + int32_t(0xFFFF0000u));
  }
}
// Where element d of a row sits in pair order.
inline int64_t pair_order(int64_t d) {
  const int64_t o = d % (2 * W);
  return d - o + (o % 2) * W + o / 2;
}

// Widen n elements to float.
inline void widen(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void widen(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = uint32_t(s[i]) << 16;
}

// Horizontal reduction by halving the vector: log2(N) shuffle-and-combine steps.
template <int N, typename Op, size_t... I>
HOT inline float reduce(typename Lanes<N>::type v, Op op, std::index_sequence<I...>) {
  if constexpr (N == 1) {
    return v[0];
  } else {
    const typename Lanes<N / 2>::type half = op(__builtin_shufflevector(v, v, I...),
                                                 __builtin_shufflevector(v, v, (I + N / 2)...));
    return reduce<N / 2>(half, op, std::make_index_sequence<N / 4>{});
  }
}
HOT inline float hsum(vfloat v) {
  return reduce<W>(v, [](auto a, auto b) { return a + b; }, std::make_index_sequence<W / 2>{});
}
HOT inline float hmax(vfloat v) {
  return reduce<W>(v, [](auto a, auto b) { return a > b ? a : b; }, std::make_index_sequence<W / 2>{});
}

// NC chunks of 2W elements of a query row, held in registers, and their lane-wise dot product
// with a K row (its hsum is the dot product): float q times float or widened bf16 K (in
// load_row's order), or with AVX512-BF16, bf16 q and K on its pairwise dot product (products of
// two bf16 are exact in float, and the sums are float).
template <int NC, typename Q>
struct QChunks {
  vfloat q[2 * NC];
  explicit QChunks(const float* p) { load_row<2 * NC>(p, q); }
  template <typename E>
  HOT vfloat dot(const E* k) const {
    vfloat s[2] = {};
    for (int c = 0; c < NC; ++c) {
      vfloat row[2];
      load_row<2>(k + c * 2 * W, row);
      s[0] += q[2 * c] * row[0];
      s[1] += q[2 * c + 1] * row[1];
    }
    return s[0] + s[1];
  }
};

#if defined(__AVX512BF16__)
HOT inline __m512bh load_bf16(const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); }

template <int NC>
struct QChunks<NC, at::BFloat16> {
  __m512bh q[NC];
  explicit QChunks(const at::BFloat16* p) {
    for (int c = 0; c < NC; ++c) q[c] = load_bf16(p + c * 2 * W);
  }
  HOT vfloat dot(const at::BFloat16* k) const {
    __m512 s = _mm512_setzero_ps();
    for (int c = 0; c < NC; ++c) s = _mm512_dpbf16_ps(s, q[c], load_bf16(k + c * 2 * W));
    return s;
  }
};
#endif

// Horizontal sums of W vectors at once: lane t of the result is the sum of p[t]'s lanes, in about
// 3 shuffle/add operations per vector instead of 2 log2(W). Round S pairs p[i] with p[i + S/2] and
// interleaves their half-width sums, which leaves the lanes in natural order at the end.
constexpr int combine_index(int s, int j) {
  const int half = s / 2, segment = j / half;
  return (segment % 2) * W + (segment / 2) * s + j % half;
}
template <int S, size_t... J>
HOT inline vfloat combine(vfloat a, vfloat b, std::index_sequence<J...>) {
  return __builtin_shufflevector(a, b, combine_index(S, J)...) +
         __builtin_shufflevector(a, b, (combine_index(S, J) + S / 2)...);
}
template <int S = W>
HOT inline vfloat transpose_sum(vfloat* p) {
  if constexpr (S == 1) {
    return p[0];
  } else {
    for (int i = 0; i < S / 2; ++i) p[i] = combine<S>(p[i], p[i + S / 2], std::make_index_sequence<W>{});
    return transpose_sum<S / 2>(p);
  }
}

// acc[0:C*W] = acc * alpha + sum_t p[t * p_stride] * v[t], with C accumulators held in registers.
template <int C, typename E>
HOT inline void pv_chunk(float* acc, float alpha, const float* p, int64_t p_stride, const E* v, int64_t stride,
                         int64_t n) {
  vfloat a[C];
  for (int c = 0; c < C; ++c) a[c] = load(acc + c * W) * alpha;
  for (int64_t t = 0; t < n; ++t) {
    const vfloat pt = splat(p[t * p_stride]);
    vfloat row[C];
    load_row<C>(v + t * stride, row);
    for (int c = 0; c < C; ++c) a[c] += pt * row[c];
  }
  for (int c = 0; c < C; ++c) store(acc + c * W, a[c]);
}

// dp is a multiple of 2W (see PagedAttention::Dp).
template <typename E>
inline void pv(float* acc, float alpha, const float* p, int64_t p_stride, const E* v, int64_t stride, int64_t n,
               int64_t dp) {
  int64_t d = 0;
  for (; d + 8 * W <= dp; d += 8 * W) pv_chunk<8>(acc + d, alpha, p, p_stride, v + d, stride, n);
  switch ((dp - d) / W) {
    case 6: return pv_chunk<6>(acc + d, alpha, p, p_stride, v + d, stride, n);
    case 4: return pv_chunk<4>(acc + d, alpha, p, p_stride, v + d, stride, n);
    case 2: return pv_chunk<2>(acc + d, alpha, p, p_stride, v + d, stride, n);
    default: return;
  }
}

// p.V for R rows at once over C vectors of the head dimension: each V row (at v + off[t]) is
// loaded once for all R rows. acc[r] = acc[r] * alpha[r] + sum_{t < n} p[r][t] v_t.
template <int R, int C, typename E>
HOT inline void pv_rows(float* acc, int64_t acc_stride, const float* alpha, const float* p, int64_t p_stride,
                        const E* v, const int64_t* off, int64_t n) {
  vfloat a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = load(acc + r * acc_stride + c * W) * alpha[r];
  for (int64_t t = 0; t < n; ++t) {
    vfloat row[C];
    load_row<C>(v + off[t], row);
    for (int r = 0; r < R; ++r) {
      const vfloat pt = splat(p[r * p_stride + t]);
      for (int c = 0; c < C; ++c) a[r][c] += pt * row[c];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store(acc + r * acc_stride + c * W, a[r][c]);
}

#if defined(__AVX512BF16__)
// The same on AVX512-BF16: p in bf16, two keys per dot product. Interleaving the 16-bit elements
// of V rows t and t + 1 (unpacklo/hi, within 128-bit lanes) pairs them up, and leaves each group
// of 2W accumulators in "unpack order" (unpack_order). n is even and p is padded with zeros.
template <int R, int C>
HOT inline void pv_rows(float* acc, int64_t acc_stride, const float* alpha, const at::BFloat16* p, int64_t p_stride,
                        const at::BFloat16* v, const int64_t* off, int64_t n) {
  static_assert(C % 2 == 0, "bf16 rows load in pairs of vectors");
  __m512 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = load(acc + r * acc_stride + c * W) * alpha[r];
  for (int64_t t = 0; t < n; t += 2) {
    __m512i pairs[C];
    for (int c = 0; c < C; c += 2) {
      const __m512i x = _mm512_loadu_si512(v + off[t] + c * W), y = _mm512_loadu_si512(v + off[t + 1] + c * W);
      pairs[c] = _mm512_unpacklo_epi16(x, y);
      pairs[c + 1] = _mm512_unpackhi_epi16(x, y);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pt;
      std::memcpy(&pt, p + r * p_stride + t, sizeof pt);  // p[t] and p[t + 1]
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(pt);
      for (int c = 0; c < C; ++c) a[r][c] = _mm512_dpbf16_ps(a[r][c], (__m512bh)pairs[c], pp);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store(acc + r * acc_stride + c * W, a[r][c]);
}
#endif

// Where element d of a row sits among the accumulators of the AVX512-BF16 p.V (pv_rows above):
// in each group of 2W = 32, element 8k + i (i < 8) is at (i / 4) * 16 + 4k + i % 4.
inline int64_t unpack_order(int64_t d) {
  const int64_t o = d % 32;
  return d - o + (o % 8 / 4) * 16 + o / 8 * 4 + o % 4;
}

// Prefetches the K and V rows of keys [from, to) (key t's at k + off[t] and v + off[t], bytes
// long). A sequence's blocks lie anywhere in the pool and one block's rows of one layer are only a
// few KB, so the hardware's stream prefetchers never get ahead of the reads: without this, a decode
// step at batch 56 read its KV at 9 GB/s on two threads, against 21 for a sequential read.
template <typename E>
HOT inline void prefetch_keys(const E* k, const E* v, const int64_t* off, int64_t from, int64_t to, int64_t bytes) {
  for (int64_t t = from; t < to; ++t) {
    const char* kt = reinterpret_cast<const char*>(k + off[t]);
    const char* vt = reinterpret_cast<const char*>(v + off[t]);
    for (int64_t b = 0; b < bytes; b += 64) {
      __builtin_prefetch(kt + b, 0, kPrefetchLocality);
      __builtin_prefetch(vt + b, 0, kPrefetchLocality);
    }
  }
}

// Scaled scores of one row for keys 0..n (n a multiple of W, key t at k + off[t], at position
// first + t), -inf past the row's position. dp is a multiple of NC chunks of 2W, usually equal.
// With ahead (the V rows, at ahead + off[t]), it prefetches the K and V rows (row_bytes each) of the
// keys kPrefetchKeys past those it scores.
template <int NC, typename Q, typename E>
HOT inline void row_scores(const Q* q, const E* k, const int64_t* off, int64_t n, int64_t dp, float scale,
                           float first, float position, float* s, const E* ahead = nullptr, int64_t row_bytes = 0) {
  constexpr int64_t step = NC * 2 * W;
  const QChunks<NC, Q> head(q);
  for (int64_t c = 0; c < n; c += W) {
    if (ahead) prefetch_keys(k, ahead, off, std::min(c + kPrefetchKeys, n), std::min(c + kPrefetchKeys + W, n), row_bytes);
    vfloat part[W];
    for (int t = 0; t < W; ++t) part[t] = head.dot(k + off[c + t]);
    for (int64_t d = step; d < dp; d += step) {
      const QChunks<NC, Q> more(q + d);
      for (int t = 0; t < W; ++t) part[t] += more.dot(k + off[c + t] + d);
    }
    const vfloat scores = transpose_sum(part) * scale;
    store(s + c, splat(first + c) + kLaneIndex <= splat(position) ? scores : splat(kNegInf));
  }
}

// 0 for each of W kept keys, -inf for the others.
typedef uint8_t vbyte __attribute__((vector_size(W)));
HOT inline vfloat kept_bias(const bool* kept) {
  vbyte b;
  std::memcpy(&b, kept, sizeof b);
  return __builtin_convertvector(b, vint) != 0 ? splat(0.0f) : splat(kNegInf);
}

// s += bias over n scores (a multiple of W): the keys bias masks (-inf) drop out.
HOT inline void add_bias(float* s, const float* bias, int64_t n) {
  for (int64_t c = 0; c < n; c += W) store(s + c, load(s + c) + load(bias + c));
}

// One online-softmax step of a row over n scores (a multiple of W): s becomes p = exp(s - m'),
// m becomes m' and l is rescaled and grown; returns the rescaling alpha = exp(m - m') of acc.
// Without a mask m' is finite (every row sees key 0, in its first tile); with one it stays -inf
// while all the keys a row has seen are masked, and exponentiating against 0 instead then gives
// p = 0 and alpha = 0 (acc and l are still 0), not NaN.
HOT inline float softmax_step(float* s, int64_t n, float& m, float& l) {
  vfloat mx = splat(m);
  for (int64_t c = 0; c < n; c += W) mx = vmax(mx, load(s + c));
  const float m_new = hmax(mx), base = m_new == kNegInf ? 0.0f : m_new;
  const float alpha = vexp(splat(m - base))[0];  // 0 on the first tile (m = -inf)
  vfloat sum{};
  for (int64_t c = 0; c < n; c += W) {
    const vfloat p = vexp(load(s + c) - base);
    store(s + c, p);
    sum += p;
  }
  m = m_new;
  l = l * alpha + hsum(sum);
  return alpha;
}

// Calls f(std::integral_constant<int, NC>) for the largest NC <= 4 that divides chunks.
template <typename F>
inline void with_chunks(int64_t chunks, F&& f) {
  if (chunks % 4 == 0) return f(std::integral_constant<int, 4>{});
  if (chunks % 3 == 0) return f(std::integral_constant<int, 3>{});
  if (chunks % 2 == 0) return f(std::integral_constant<int, 2>{});
  return f(std::integral_constant<int, 1>{});
}

// Calls f(std::integral_constant<int, R>) for R = r, 1 <= r <= 4.
template <typename F>
inline void with_rows(int64_t r, F&& f) {
  switch (r) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    default: return f(std::integral_constant<int, 4>{});
  }
}

#if defined(__AVX512BF16__)
// n floats (a multiple of 2W) to bf16, rounding to nearest even.
HOT inline void to_bf16(const float* s, at::BFloat16* p, int64_t n) {
  for (int64_t c = 0; c < n; c += 2 * W) _mm512_storeu_si512(p + c, (__m512i)_mm512_cvtne2ps_pbh(load(s + c + W), load(s + c)));
}
#endif

// Scores of NT consecutive keys for RV vectors of rows (rows in lanes), masked causally.
template <int RV, int NT>
HOT inline void lane_scores(const float* qT, int64_t rp, const float* k, int64_t stride, int64_t D, float* out,
                            float position, const vfloat* pos) {
  vfloat s[NT][RV] = {};
  for (int64_t d = 0; d < D; ++d) {
    vfloat q[RV];
    for (int rv = 0; rv < RV; ++rv) q[rv] = load(qT + d * rp + rv * W);
    for (int nt = 0; nt < NT; ++nt) {
      const vfloat kd = splat(k[nt * stride + d]);
      for (int rv = 0; rv < RV; ++rv) s[nt][rv] += q[rv] * kd;
    }
  }
  for (int nt = 0; nt < NT; ++nt)
    for (int rv = 0; rv < RV; ++rv)
      store(out + nt * rp + rv * W, splat(position + nt) <= pos[rv] ? s[nt][rv] : splat(kNegInf));
}

struct Item {
  int32_t seq, begin, end;  // queries [begin, end) of the sequence
  int32_t head, heads;      // KV heads [head, head + heads)
  int64_t cost;
};

constexpr int64_t kKeyTile = 256;  // keys per online-softmax step of the few-rows path, a multiple of 2W

// Per-thread buffers, kept across calls (the OpenMP threads persist) and grown on demand.
struct Scratch {
  std::vector<float> q, acc, m, l, pos, alpha, scores, k, v;
  std::vector<float> bias;           // a tile's keys: 0, or -inf where valid masks them
  std::vector<at::BFloat16> qb, pb;  // q and p in bf16, for AVX512-BF16
  std::vector<int64_t> off;          // where each key of a tile starts

  // The blocks of the item this thread will likely take next, prefetched `per_drip` cache lines
  // at each drip: run_rows drips after each row's scores and before each group's p.V, so the
  // reads spread over the current item's compute instead of queueing behind one another.
  struct Ahead {
    std::vector<const char*> blocks;
    int64_t block_bytes = 0, line = 0, lines = 0, per_drip = 0;
    HOT void drip() {
      for (const int64_t end = std::min(lines, line + per_drip); line < end; ++line) {
        const int64_t byte = line * 64;
        __builtin_prefetch(blocks[byte / block_bytes] + byte % block_bytes, 0, kPrefetchLocality);
      }
    }
  } ahead;
  void reserve(int64_t rows, int64_t dp, int64_t block, int64_t heads) {
    const int64_t keys = std::max(round_up(block, W), kKeyTile);
    for (auto* b : {&q, &acc}) grow(*b, rows * dp);
    for (auto* b : {&m, &l, &pos, &alpha}) grow(*b, rows);
    grow(scores, keys * rows);
    for (auto* b : {&k, &v}) grow(*b, keys * heads * dp);
    grow(qb, rows * dp);
    grow(pb, rows * kKeyTile);
    grow(off, kKeyTile);
    grow(bias, kKeyTile);
  }
  template <typename T>
  static void grow(std::vector<T>& b, int64_t n) {
    if (int64_t(b.size()) < n) b.resize(n);
  }
};

// A tile's K and V rows: key t of KV head h (relative to the item's first) at k + off[t] + h * head_stride.
template <typename E>
struct TileRows {
  const E* k;
  const E* v;
  int64_t head_stride;
};

template <typename scalar_t>
struct PagedAttention {
  const scalar_t* q;
  int64_t q_stride;  // between tokens of q, whose heads are contiguous
  const scalar_t* pool;
  scalar_t* out;
  const int32_t* table;
  const int32_t* seq_lens;
  const int32_t* starts;
  const bool* valid;  // [num_blocks][L]: whether each slot's key takes part; nullptr: all do
  int64_t M, L, Hq, Hkv, G, D;
  int64_t Dp;  // D rounded up to whole pairs of vectors; rows of other lengths are widened and padded
  float scale;

  // Keys the item's last query sees: its sequence's context up to that query.
  int64_t visible_keys(const Item& it) const {
    return seq_lens[it.seq] - (starts[it.seq + 1] - starts[it.seq]) + it.end;
  }

  // Whether the item takes run_lanes (many rows of one KV head: prefill tiles), else run_rows.
  bool lanes(const Item& it) const {
    const int64_t rows = (it.end - it.begin) * it.heads * G;
    return it.heads == 1 && rows >= W && rows <= kMaxRowVecs * W;
  }

  // Plans sc.ahead: the blocks of `next` (every key it reads, all heads), spread over the drips
  // that run_rows makes while it computes `now`; nothing when `now` takes run_lanes, which does
  // not drip (a prefill tile is bound by its compute).
  void plan_ahead(const Item& now, const Item* next, Scratch& sc) const {
    Scratch::Ahead& a = sc.ahead;
    a.blocks.clear();
    a.line = a.lines = 0;
    if (next == nullptr || lanes(now)) return;
    const int64_t block_elems = 2 * L * Hkv * D;
    for (int64_t b = 0, n = (visible_keys(*next) + L - 1) / L; b < n; ++b)
      a.blocks.push_back(reinterpret_cast<const char*>(pool + int64_t(table[next->seq * M + b]) * block_elems));
    a.block_bytes = block_elems * int64_t(sizeof(scalar_t));
    a.lines = int64_t(a.blocks.size()) * a.block_bytes / 64;
    const int64_t drips = 2 * (now.end - now.begin) * now.heads * G * ((visible_keys(now) + kKeyTile - 1) / kKeyTile);
    a.per_drip = (a.lines + drips - 1) / std::max<int64_t>(drips, 1);
  }

  void run(const Item& it, Scratch& sc) const {
    if (lanes(it)) {
      run_lanes(it, sc);
    } else if constexpr (std::is_same_v<scalar_t, float>) {
      run_rows<float, float>(it, sc);
    } else if (D != Dp) {
      run_rows<float, float>(it, sc);  // widened
    } else {
#if defined(__AVX512BF16__)
      run_rows<at::BFloat16, at::BFloat16>(it, sc);
#else
      run_rows<float, at::BFloat16>(it, sc);
#endif
    }
  }

  // Few rows (decodes, and prefill chunks of under W rows per KV head), head-major: row
  // h * RG + i * G + g is query it.begin + i and query head (it.head + h) * G + g. Keys come in
  // tiles of kKeyTile across blocks; per tile and KV head: each row's scores (W dot products
  // reduced at once), its online-softmax step, then p.V with each V row loaded once for all the
  // head's rows. Q is how q (and p) are held: float, or bf16 for AVX512-BF16; E is how K/V rows are
  // read: in place, or widened to float.
  template <typename Q, typename E>
  void run_rows(const Item& it, Scratch& sc) const {
    constexpr bool native_bf16 = std::is_same_v<Q, at::BFloat16>;
    constexpr bool paired = std::is_same_v<Q, float> && std::is_same_v<E, at::BFloat16>;  // load_row's order
    const int64_t q0 = starts[it.seq], nq = it.end - it.begin;
    const int64_t first = seq_lens[it.seq] - (starts[it.seq + 1] - q0) + it.begin;  // position of query it.begin
    const int64_t RG = nq * G, rows = it.heads * RG;
    const auto token = [&](int64_t r) { return q0 + it.begin + r % RG / G; };
    const auto head = [&](int64_t r) { return (it.head + r / RG) * G + r % G; };
    Q* qs;
    if constexpr (native_bf16) {
      qs = sc.qb.data();
    } else {
      qs = sc.q.data();
    }
    std::fill(qs, qs + rows * Dp, Q(0));
    for (int64_t r = 0; r < rows; ++r) {
      const scalar_t* src = q + token(r) * q_stride + head(r) * D;
      for (int64_t d = 0; d < D; ++d) qs[r * Dp + (paired ? pair_order(d) : d)] = static_cast<Q>(src[d]);
      sc.pos[r] = float(first + r % RG / G);
    }
    std::fill(sc.acc.begin(), sc.acc.begin() + rows * Dp, 0.0f);
    std::fill(sc.m.begin(), sc.m.begin() + rows, kNegInf);
    std::fill(sc.l.begin(), sc.l.begin() + rows, 0.0f);

    const int64_t keys = first + nq;  // keys visible to the last query
    // Rows read in place are prefetched: each tile's first keys at its start, the rest while row 0
    // scores (all the item's heads at once, a key's rows being adjacent in the pool).
    const bool in_place = std::is_same_v<E, scalar_t> && D == Dp;
    const int64_t row_bytes = it.heads * D * int64_t(sizeof(E));
    for (int64_t t0 = 0; t0 < keys; t0 += kKeyTile) {
      const int64_t tb = std::min(kKeyTile, keys - t0), n = round_up(tb, 2 * W);
      const TileRows<E> tile = tile_rows<E>(it, t0, tb, n, sc);
      if (valid) tile_bias(it, t0, tb, n, sc.bias.data());
      if (in_place) prefetch_keys(tile.k, tile.v, sc.off.data(), 0, std::min(kPrefetchKeys, n), row_bytes);
      for (int64_t h = 0; h < it.heads; ++h) {
        const int64_t r0 = h * RG;
        for (int64_t r = r0; r < r0 + RG; ++r) {
          float* s = sc.scores.data() + r * kKeyTile;
          with_chunks(Dp / (2 * W), [&](auto NC) {
            row_scores<decltype(NC)::value>(qs + r * Dp, tile.k + h * tile.head_stride, sc.off.data(), n, Dp,
                                            scale, float(t0), sc.pos[r], s, in_place && r == 0 ? tile.v : nullptr,
                                            row_bytes);
          });
          if (valid) add_bias(s, sc.bias.data(), n);
          sc.alpha[r] = softmax_step(s, n, sc.m[r], sc.l[r]);
          sc.ahead.drip();
#if defined(__AVX512BF16__)
          if constexpr (native_bf16) to_bf16(s, sc.pb.data() + r * kKeyTile, n);
#endif
        }
        const Q* p;
        if constexpr (native_bf16) {
          p = sc.pb.data();
        } else {
          p = sc.scores.data();
        }
        for (int64_t r = r0; r < r0 + RG; r += 4) {
          with_rows(std::min<int64_t>(4, r0 + RG - r), [&](auto R) {
            constexpr int kRows = decltype(R)::value;
            for (int i = 0; i < kRows; ++i) sc.ahead.drip();
            for (int64_t d = 0; d < Dp; d += 4 * W) {
              float* acc = sc.acc.data() + r * Dp + d;
              const E* v = tile.v + h * tile.head_stride + d;
              if (Dp - d >= 4 * W) {
                pv_rows<kRows, 4>(acc, Dp, sc.alpha.data() + r, p + r * kKeyTile, kKeyTile, v, sc.off.data(), n);
              } else {
                pv_rows<kRows, 2>(acc, Dp, sc.alpha.data() + r, p + r * kKeyTile, kKeyTile, v, sc.off.data(), n);
              }
            }
          });
        }
      }
    }

    for (int64_t r = 0; r < rows; ++r) {
      const float inv = 1.0f / sc.l[r];
      const float* acc = sc.acc.data() + r * Dp;
      scalar_t* dst = out + (token(r) * Hq + head(r)) * D;
      for (int64_t d = 0; d < D; ++d) {
        const int64_t i = native_bf16 ? unpack_order(d) : paired ? pair_order(d) : d;
        dst[d] = static_cast<scalar_t>(acc[i] * inv);
      }
    }
  }

  // The rows of keys t0 .. t0 + n of the item's sequence; keys past tb repeat the last one, so that
  // padding reads real data (never uninitialised memory, which could be NaN and poison 0 * V).
  template <typename E>
  TileRows<E> tile_rows(const Item& it, int64_t t0, int64_t tb, int64_t n, Scratch& sc) const {
    const int64_t token_stride = Hkv * D;  // between consecutive tokens of one head in a block
    int64_t* off = sc.off.data();
    for (int64_t t = 0; t < tb;) {  // block by block
      const int64_t p = t0 + t, end = std::min(tb, t + L - p % L);
      for (int64_t o = (int64_t(table[it.seq * M + p / L]) * 2 * L + p % L) * token_stride; t < end; ++t)
        off[t] = o, o += token_stride;
    }
    std::fill(off + tb, off + n, off[tb - 1]);
    if constexpr (std::is_same_v<E, scalar_t>) {
      if (D == Dp) return {pool + it.head * D, pool + L * token_stride + it.head * D, D};
    }
    if constexpr (std::is_same_v<E, float>) {  // widened to [key][head][Dp], zero-padded
      for (int64_t t = 0; t < tb; ++t) {
        for (int64_t h = 0; h < it.heads; ++h) {
          const scalar_t* k = pool + off[t] + (it.head + h) * D;
          float* kd = sc.k.data() + (t * it.heads + h) * Dp;
          float* vd = sc.v.data() + (t * it.heads + h) * Dp;
          widen(k, kd, D);
          widen(k + L * token_stride, vd, D);
          std::fill(kd + D, kd + Dp, 0.0f);
          std::fill(vd + D, vd + Dp, 0.0f);
        }
      }
      for (int64_t t = 0; t < n; ++t) off[t] = std::min(t, tb - 1) * it.heads * Dp;
      return {sc.k.data(), sc.v.data(), Dp};
    } else {
      __builtin_unreachable();  // bf16 rows are read in place only
    }
  }

  // bias[t] for the keys t0 .. t0 + n of the item's sequence: 0, or -inf where valid masks the
  // key; 0 for the padding past tb.
  void tile_bias(const Item& it, int64_t t0, int64_t tb, int64_t n, float* bias) const {
    for (int64_t t = 0; t < tb;) {  // block by block
      const int64_t p = t0 + t, end = std::min(tb, t + L - p % L);
      const bool* kept = valid + int64_t(table[it.seq * M + p / L]) * L + p % L;
      for (; t + W <= end; t += W, kept += W) store(bias + t, kept_bias(kept));
      for (; t < end; ++t) bias[t] = *kept++ ? 0.0f : kNegInf;
    }
    std::fill(bias + tb, bias + n, 0.0f);
  }

  // Many rows (prefill tiles of one KV head): rows in vector lanes, query-major (row r is query
  // it.begin + r / G and query head it.head * G + r % G), padded to whole vectors with copies of
  // the last row's position, which keeps their softmax finite. float blocks are read in place;
  // bf16 ones (and rows of other lengths) are widened into sc.k / sc.v, once per block.
  void run_lanes(const Item& it, Scratch& sc) const {
    const int64_t q0 = starts[it.seq];
    const int64_t first = seq_lens[it.seq] - (starts[it.seq + 1] - q0);  // position of query 0
    const int64_t rows = (it.end - it.begin) * G, rp = round_up(rows, W);
    const bool in_place = std::is_same_v<scalar_t, float> && D == Dp;
    float* qs = sc.q.data();  // transposed: [D][rp]
    std::fill(qs, qs + rp * Dp, 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      const scalar_t* src = q + (q0 + it.begin + r / G) * q_stride + (it.head * G + r % G) * D;
      for (int64_t d = 0; d < D; ++d) qs[d * rp + r] = static_cast<float>(src[d]) * scale;
    }
    for (int64_t r = 0; r < rp; ++r) sc.pos[r] = float(first + it.begin + std::min(r, rows - 1) / G);
    std::fill(sc.acc.begin(), sc.acc.begin() + rp * Dp, 0.0f);
    std::fill(sc.m.begin(), sc.m.begin() + rp, kNegInf);
    std::fill(sc.l.begin(), sc.l.begin() + rp, 0.0f);

    const int64_t keys = first + it.end;  // keys visible to the tile's last query
    const int64_t token_stride = Hkv * D;  // between consecutive tokens of one head in a block
    for (int64_t t0 = 0; t0 < keys; t0 += L) {
      const int64_t tb = std::min(L, keys - t0);
      const int64_t block = table[it.seq * M + t0 / L];
      const scalar_t* kb = pool + (block * 2 * L * Hkv + it.head) * D;
      const scalar_t* vb = kb + L * token_stride;
      const bool* kept = valid ? valid + block * L : nullptr;
      const float* k = sc.k.data();
      const float* v = sc.v.data();
      int64_t stride = Dp;
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (in_place) k = kb, v = vb, stride = token_stride;
      }
      if (!in_place) {  // to [token][Dp]
        for (int64_t t = 0; t < tb; ++t) {
          widen(kb + t * token_stride, sc.k.data() + t * Dp, D);
          widen(vb + t * token_stride, sc.v.data() + t * Dp, D);
          std::fill(sc.k.data() + t * Dp + D, sc.k.data() + (t + 1) * Dp, 0.0f);
          std::fill(sc.v.data() + t * Dp + D, sc.v.data() + (t + 1) * Dp, 0.0f);
        }
      }
      switch (rp / W) {
        case 1: lane_block<1>(k, v, stride, t0, tb, rows, kept, sc); break;
        case 2: lane_block<2>(k, v, stride, t0, tb, rows, kept, sc); break;
        case 3: lane_block<3>(k, v, stride, t0, tb, rows, kept, sc); break;
        default: lane_block<4>(k, v, stride, t0, tb, rows, kept, sc); break;
      }
    }

    for (int64_t r = 0; r < rows; ++r) {
      const float inv = 1.0f / sc.l[r];
      const float* acc = sc.acc.data() + r * Dp;
      scalar_t* dst = out + ((q0 + it.begin + r / G) * Hq + it.head * G + r % G) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[d] * inv);
    }
  }

  // Many rows: RV vectors of rows in lanes; q is transposed to [D][RV * W]. kept: the block's
  // entries of valid, or nullptr.
  template <int RV>
  void lane_block(const float* k, const float* v, int64_t stride, int64_t t0, int64_t tb, int64_t rows,
                  const bool* kept, Scratch& sc) const {
    constexpr int64_t rp = RV * W;
    float* s = sc.scores.data();  // [tb][rp]
    vfloat pos[RV];
    for (int rv = 0; rv < RV; ++rv) pos[rv] = load(sc.pos.data() + rv * W);
    int64_t t = 0;
    for (; t + 2 <= tb; t += 2) lane_scores<RV, 2>(sc.q.data(), rp, k + t * stride, stride, D, s + t * rp, t0 + t, pos);
    if (t < tb) lane_scores<RV, 1>(sc.q.data(), rp, k + t * stride, stride, D, s + t * rp, t0 + t, pos);
    if (kept) {
      for (t = 0; t < tb; ++t)
        if (!kept[t]) std::fill(s + t * rp, s + (t + 1) * rp, kNegInf);
    }
    for (int rv = 0; rv < RV; ++rv) {
      const vfloat m = load(sc.m.data() + rv * W);
      vfloat mx = m;
      for (t = 0; t < tb; ++t) mx = vmax(mx, load(s + t * rp + rv * W));
      const vfloat base = mx == splat(kNegInf) ? vfloat{} : mx;  // as in softmax_step
      const vfloat alpha = vexp(m - base);
      vfloat sum{};
      for (t = 0; t < tb; ++t) {
        const vfloat p = vexp(load(s + t * rp + rv * W) - base);
        store(s + t * rp + rv * W, p);
        sum += p;
      }
      store(sc.m.data() + rv * W, mx);
      store(sc.l.data() + rv * W, load(sc.l.data() + rv * W) * alpha + sum);
      store(sc.alpha.data() + rv * W, alpha);
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = std::min<int64_t>(tb, int64_t(sc.pos[r]) + 1 - t0);
      if (n > 0) pv(sc.acc.data() + r * Dp, sc.alpha[r], s + r, rp, v, stride, n, Dp);  // else alpha is 1
    }
  }
};

template <typename scalar_t>
void launch(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& table, const at::Tensor& seq_lens,
            const at::Tensor& starts, const bool* valid, double scale, at::Tensor& out) {
  const int64_t S = table.size(0), L = pool.size(2), Hkv = pool.size(3), Hq = q.size(1), D = q.size(2);
  const int64_t G = Hq / Hkv, tile = std::max<int64_t>(1, kMaxRowVecs * W / G);
  const PagedAttention<scalar_t> pa{q.data_ptr<scalar_t>(), q.stride(0), pool.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                    table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), starts.data_ptr<int32_t>(),
                                    valid, table.size(1), L, Hq, Hkv, G, D, round_up(D, 2 * W),
                                    static_cast<float>(scale)};
  // Sequences with few rows (decodes) take all KV heads in one item, so that each block is read
  // front to back once; unless that leaves too few items to keep the threads busy.
  const int64_t threads = at::get_num_threads();
  int64_t count = 0;  // items with the heads grouped
  for (int32_t s = 0; s < S; ++s) {
    const int64_t nq = pa.starts[s + 1] - pa.starts[s];
    count += nq == 0 ? 0 : nq * G < W ? 1 : (nq + tile - 1) / tile * Hkv;
  }
  const int64_t wanted = threads == 1 ? 1 : 4 * threads;
  const int64_t splits = std::clamp<int64_t>((wanted + count - 1) / std::max<int64_t>(count, 1), 1, Hkv);
  const int32_t group = (Hkv + splits - 1) / splits;
  std::vector<Item> items;
  for (int32_t s = 0; s < S; ++s) {
    const int32_t nq = pa.starts[s + 1] - pa.starts[s], first = pa.seq_lens[s] - nq;
    const bool grouped = nq * G < W;
    for (int32_t b = 0; b < nq; b += grouped ? nq : tile) {
      const int32_t e = grouped ? nq : std::min<int32_t>(nq, b + tile);
      for (int32_t g = 0; g < Hkv; g += grouped ? group : 1) {
        const int32_t heads = grouped ? std::min<int32_t>(group, Hkv - g) : 1;
        items.push_back({s, b, e, g, heads, int64_t(e - b) * heads * (first + e)});
      }
    }
  }
  // Largest first, handed out dynamically: decodes and prefill tiles of any length balance well.
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t rows = std::max(round_up(tile * G, W), round_up(W * Hkv, W));
  int64_t cost = 0;
  for (const Item& it : items) cost += it.cost;
  const int64_t helpers = std::min(threads, cost / kMinCostPerThread);  // waking a thread has a price
  const int64_t items_n = int64_t(items.size()), stride = std::max<int64_t>(helpers, 1);
  std::atomic<int64_t> next{0};
  const auto work = [&](int64_t, int64_t) {
    thread_local Scratch sc;
    sc.reserve(rows, pa.Dp, L, Hkv);
    for (int64_t i = next.fetch_add(1); i < items_n; i = next.fetch_add(1)) {
      // the item this thread likely takes next: each of `stride` threads takes one in turn
      pa.plan_ahead(items[i], i + stride < items_n ? &items[i + stride] : nullptr, sc);
      pa.run(items[i], sc);
    }
  };
  if (helpers > 1) {
    at::parallel_for(0, helpers, 1, work);
  } else {
    work(0, 2);
  }
}

// [T, H, D] whose tokens may be strided but each token's heads are contiguous, as in a view of
// the fused qkv projection.
bool rows_contiguous(const at::Tensor& x) {
  return x.dim() == 3 && x.stride(2) == 1 && (x.size(1) == 1 || x.stride(1) == x.size(2));
}

void check_inputs(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& table, const at::Tensor& seq_lens,
                  const at::Tensor& starts, const std::optional<at::Tensor>& valid) {
  TORCH_CHECK_VALUE(q.device().is_cpu() && pool.device().is_cpu() && table.device().is_cpu() &&
                        seq_lens.device().is_cpu() && starts.device().is_cpu(),
                    "paged_attention kernel: CPU tensors only");
  TORCH_CHECK_VALUE(q.dim() == 3 && pool.dim() == 5 && table.dim() == 2, "paged_attention: bad ranks");
  TORCH_CHECK_VALUE(rows_contiguous(q) && pool.is_contiguous() && table.is_contiguous() &&
                        seq_lens.is_contiguous() && starts.is_contiguous(),
                    "paged_attention: tensors must be contiguous (q: each token's heads)");
  TORCH_CHECK_VALUE(q.scalar_type() == pool.scalar_type(), "paged_attention: q and pool dtypes differ");
  TORCH_CHECK_VALUE(table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                        starts.scalar_type() == at::kInt,
                    "paged_attention: block_table, seq_lens and query_start_loc must be int32");
  const int64_t S = table.size(0), M = table.size(1), NB = pool.size(0), L = pool.size(2);
  TORCH_CHECK_VALUE(pool.size(1) == 2 && pool.size(4) == q.size(2), "paged_attention: pool shape does not match q");
  TORCH_CHECK_VALUE(q.size(1) % pool.size(3) == 0, "paged_attention: Hq must be a multiple of Hkv");
  if (valid) {
    TORCH_CHECK_VALUE(valid->device().is_cpu(), "paged_attention kernel: CPU tensors only");
    TORCH_CHECK_VALUE(valid->scalar_type() == at::kBool && valid->dim() == 2 && valid->size(0) == NB &&
                          valid->size(1) == L && valid->is_contiguous(),
                      "paged_attention: valid must be a contiguous bool [", NB, ", ", L, "], got ",
                      valid->scalar_type(), " ", valid->sizes());
  }
  TORCH_CHECK_VALUE(seq_lens.numel() == S && starts.numel() == S + 1,
                    "paged_attention: seq_lens must have S and query_start_loc S + 1 entries");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* st = starts.data_ptr<int32_t>();
  const int32_t* tab = table.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(st[0] == 0 && st[S] == q.size(0), "paged_attention: query_start_loc must run from 0 to T");
  for (int64_t s = 0; s < S; ++s) {
    const int64_t nq = st[s + 1] - st[s], len = lens[s];
    TORCH_CHECK_VALUE(nq >= 0 && nq <= len, "paged_attention: sequence ", s, " has ", nq, " queries but ", len,
                      " tokens");
    TORCH_CHECK_VALUE(len <= M * L, "paged_attention: sequence ", s, " has ", len,
                      " tokens, more than its block table holds");
    TORCH_CHECK_VALUE(len <= kMaxPosition, "paged_attention: sequences longer than ", kMaxPosition, " tokens");
    if (nq == 0) continue;  // no queries: its blocks are never read
    for (int64_t j = 0; j * L < len; ++j)
      TORCH_CHECK_VALUE(tab[s * M + j] >= 0 && tab[s * M + j] < NB, "paged_attention: sequence ", s,
                        " has block id ", tab[s * M + j], " outside the pool");
  }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& table,
                           const at::Tensor& seq_lens, const at::Tensor& starts, double scale,
                           const std::optional<at::Tensor>& valid) {
  check_inputs(q, pool, table, seq_lens, starts, valid);
  at::Tensor out = at::empty_like(q);
  const bool* kept = valid ? valid->data_ptr<bool>() : nullptr;
  if (q.scalar_type() == at::kFloat) {
    launch<float>(q, pool, table, seq_lens, starts, kept, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    launch<at::BFloat16>(q, pool, table, seq_lens, starts, kept, scale, out);
  } else {
    TORCH_CHECK_VALUE(false, "paged_attention: dtype must be float32 or bfloat16, got ", q.scalar_type());
  }
  return out;
}

void write_kv(at::Tensor& pool, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  TORCH_CHECK_VALUE(pool.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && slots.device().is_cpu(),
                    "write_kv kernel: CPU tensors only");
  TORCH_CHECK_VALUE(pool.dim() == 5 && pool.size(1) == 2 && pool.is_contiguous(), "write_kv: bad pool");
  TORCH_CHECK_VALUE(rows_contiguous(k) && rows_contiguous(v) && slots.is_contiguous(),
                    "write_kv: tensors must be contiguous (k, v: each token's heads)");
  TORCH_CHECK_VALUE(k.scalar_type() == pool.scalar_type() && v.scalar_type() == pool.scalar_type(),
                    "write_kv: k, v and pool dtypes differ");
  TORCH_CHECK_VALUE(slots.scalar_type() == at::kLong, "write_kv: slot_mapping must be int64");
  const int64_t T = slots.numel(), L = pool.size(2), capacity = pool.size(0) * L;
  TORCH_CHECK_VALUE(k.sizes() == v.sizes() && k.dim() == 3 && k.size(0) == T && k.size(1) == pool.size(3) &&
                        k.size(2) == pool.size(4),
                    "write_kv: k and v must be [T, Hkv, D] matching the pool and slot_mapping");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK_VALUE(s[t] >= 0 && s[t] < capacity, "write_kv: slot ", s[t], " outside the pool");
  const int64_t bytes = pool.size(3) * pool.size(4) * pool.element_size();
  char* dst = static_cast<char*>(pool.data_ptr());
  const char* ks = static_cast<const char*>(k.data_ptr());
  const char* vs = static_cast<const char*>(v.data_ptr());
  const int64_t k_stride = k.stride(0) * k.element_size(), v_stride = v.stride(0) * v.element_size();
  at::parallel_for(0, T, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = s[t] / L, offset = s[t] % L;
      std::memcpy(dst + (block * 2 * L + offset) * bytes, ks + t * k_stride, bytes);
      std::memcpy(dst + ((block * 2 + 1) * L + offset) * bytes, vs + t * v_stride, bytes);
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels release the GIL: the engine runs on its own thread next to the HTTP server.
  m.def("paged_attention", &paged_attention, "Paged attention over the KV pool (docs/engine.md)", py::arg("q"),
        py::arg("pool"), py::arg("block_table"), py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("scale"),
        py::arg("valid") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("write_kv", &write_kv, "Write k and v into the pool at slot_mapping",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &kvmesh::rms_norm, "RMSNorm of each row", py::call_guard<py::gil_scoped_release>());
  m.def("rotary", &kvmesh::rotary, "Rotary embedding of q and k", py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &kvmesh::silu_mul, "silu(gate) * up", py::call_guard<py::gil_scoped_release>());
  m.def("quant_linear_tile_rows", &kvmesh::quant_linear_tile_rows,
        "The fewest rows of bf16 x that take the AMX tile path, 0 where there is none");
  m.def("q4_1_linear", &kvmesh::q4_1_linear, "x @ W^T (+ residual) for W in GGUF Q4_1 blocks", py::arg("x"),
        py::arg("qs"), py::arg("scales"), py::arg("mins"), py::arg("residual") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("q4_1_linear_bf16", &kvmesh::q4_1_linear_bf16,
        "x @ W^T (+ residual) for bf16 x and W in Q4_1 blocks, 16 rows side by side", py::arg("x"), py::arg("qs"),
        py::arg("scales"), py::arg("mins"), py::arg("N"), py::arg("residual") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_linear_bf16_dots", &kvmesh::quant_linear_bf16_dots,
        "Whether q4_1_linear_bf16 is built here (a CPU with AVX512-BF16)");
  m.def("q8_0_linear", &kvmesh::q8_0_linear, "x @ W^T (+ residual) for W in GGUF Q8_0 blocks", py::arg("x"),
        py::arg("qs"), py::arg("scales"), py::arg("residual") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("copy_rows", &kvmesh::copy_rows, "Copy rows (KV blocks) of one tensor into rows of another",
        py::arg("source"), py::arg("source_rows"), py::arg("target"), py::arg("target_rows"),
        py::call_guard<py::gil_scoped_release>());
}
