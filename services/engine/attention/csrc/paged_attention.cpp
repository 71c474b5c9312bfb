// Paged attention on CPU over the KV pool, reading K/V blocks in place (layout: docs/engine.md).
//
// A work item is one sequence's tile of queries against one KV head (prefill), or against all
// its KV heads (decode: few queries, so each block is read front to back once). Its rows are
// (query, query head) pairs, so each K/V block loaded serves all of them, GQA included. Each row
// keeps a flash-style online softmax (running max m, sum l, accumulator acc) over the sequence's
// blocks, in float32. Two layouts of the scores:
//  - few rows: per row, a dot product per key vectorised along head_dim, then W of them reduced
//    at once (transpose_sum); bf16 is widened in registers;
//  - many rows (prefill tiles): rows in vector lanes, so no horizontal sums at all; bf16 blocks
//    (and head_dims that are not whole pairs of vectors) are widened into a per-thread buffer,
//    once per block for all rows.
// Items are handed out to at::parallel_for's threads dynamically, largest first.
// Needs GCC >= 12 or Clang (vector extensions with __builtin_shufflevector), little-endian.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#define HOT [[gnu::always_inline]]  // hot-loop helpers must inline whatever the optimiser thinks

namespace {

// A vector of W floats (GCC/Clang vector extension), lowered to the widest registers -march allows.
#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX__)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif
template <int N>
struct Lanes {
  typedef float type __attribute__((vector_size(N * sizeof(float))));
};
typedef Lanes<W>::type vfloat;
typedef int32_t vint __attribute__((vector_size(W * sizeof(int32_t))));

constexpr int kMaxRowVecs = 4;  // a prefill tile has up to kMaxRowVecs * W rows
constexpr int64_t kMinCostPerThread = 4096;  // (query row, key) pairs, a few microseconds of work
constexpr int64_t kMaxPosition = 1 << 24;  // positions are compared as floats, exact up to here
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
template <size_t... I>
HOT inline vfloat splat(float x, std::index_sequence<I...>) { return vfloat{((void)I, x)...}; }  // one broadcast
HOT inline vfloat splat(float x) { return splat(x, std::make_index_sequence<W>{}); }
HOT inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }
template <size_t... I>
constexpr vfloat iota(std::index_sequence<I...>) { return vfloat{float(I)...}; }
constexpr vfloat kLaneIndex = iota(std::make_index_sequence<W>{});
HOT inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
HOT inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

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

// exp for softmax arguments (x <= 0), Cephes polynomial, relative error ~1e-7; exactly 0 below -87,
// which covers -inf (masked keys).
HOT inline vfloat vexp(vfloat x) {
  const auto tiny = x < splat(-87.0f);
  x = tiny ? splat(-87.0f) : x;
  const vfloat n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round to nearest integer
  const vfloat r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vfloat p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;
  return tiny ? vfloat{} : p * reinterpret_cast<vfloat>(bits);
}

// Lane sums of the dot product a . b (its hsum is the dot product).
template <typename E>
HOT inline vfloat dot_lanes(const float* a, const E* b, int64_t dp) {
  vfloat s[2] = {};
  for (int64_t i = 0; i < dp; i += 2 * W) {
    vfloat row[2];
    load_row<2>(b + i, row);
    s[0] += load(a + i) * row[0];
    s[1] += load(a + i + W) * row[1];
  }
  return s[0] + s[1];
}

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

// Per-thread buffers, kept across calls (the OpenMP threads persist) and grown on demand.
struct Scratch {
  std::vector<float> q, acc, m, l, pos, alpha, scores, k, v;
  void reserve(int64_t rows, int64_t dp, int64_t block, int64_t heads) {
    for (auto* b : {&q, &acc}) grow(*b, rows * dp);
    for (auto* b : {&m, &l, &pos, &alpha}) grow(*b, rows);
    grow(scores, round_up(block, W) * rows);
    for (auto* b : {&k, &v}) grow(*b, block * heads * dp);
  }
  static void grow(std::vector<float>& b, int64_t n) {
    if (int64_t(b.size()) < n) b.resize(n);
  }
};

template <typename scalar_t>
struct PagedAttention {
  const scalar_t* q;
  const scalar_t* pool;
  scalar_t* out;
  const int32_t* table;
  const int32_t* seq_lens;
  const int32_t* starts;
  int64_t M, L, Hq, Hkv, G, D;
  int64_t Dp;  // D rounded up to whole pairs of vectors; rows of other lengths are widened and padded
  float scale;

  // Rows are (query, query head) pairs, query-major as in q: row r is query r / HG and query head
  // head * G + r % HG, where HG = heads * G. They are padded to whole vectors with copies of the
  // last row's position, which keeps their softmax finite.
  void run(const Item& it, Scratch& sc) const {
    const int64_t q0 = starts[it.seq];
    const int64_t first = seq_lens[it.seq] - (starts[it.seq + 1] - q0);  // position of query 0
    const int64_t HG = it.heads * G, rows = (it.end - it.begin) * HG, rp = round_up(rows, W);
    const bool lanes = it.heads == 1 && rows >= W && rows <= kMaxRowVecs * W;
    // Blocks read in place, or widened into sc.k / sc.v; in place bf16 rows are in pair order.
    const bool in_place = D == Dp && (!lanes || std::is_same_v<scalar_t, float>);
    const bool paired = in_place && !lanes && !std::is_same_v<scalar_t, float>;
    float* qs = sc.q.data();
    std::fill(qs, qs + rp * Dp, 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      const scalar_t* src = q + ((q0 + it.begin + r / HG) * Hq + it.head * G + r % HG) * D;
      for (int64_t d = 0; d < D; ++d) {
        const float x = static_cast<float>(src[d]) * scale;
        if (lanes) {
          qs[d * rp + r] = x;  // transposed: [D][rp]
        } else {
          qs[r * Dp + (paired ? pair_order(d) : d)] = x;
        }
      }
    }
    for (int64_t r = 0; r < rp; ++r) sc.pos[r] = float(first + it.begin + std::min(r, rows - 1) / HG);
    std::fill(sc.acc.begin(), sc.acc.begin() + rp * Dp, 0.0f);
    std::fill(sc.m.begin(), sc.m.begin() + rp, kNegInf);
    std::fill(sc.l.begin(), sc.l.begin() + rp, 0.0f);

    const int64_t keys = first + it.end;  // keys visible to the tile's last query
    const int64_t token_stride = Hkv * D;  // between consecutive tokens of one head in a block
    for (int64_t t0 = 0; t0 < keys; t0 += L) {
      const int64_t tb = std::min(L, keys - t0);
      const scalar_t* kb = pool + (int64_t(table[it.seq * M + t0 / L]) * 2 * L * Hkv + it.head) * D;
      const scalar_t* vb = kb + L * token_stride;
      if (!in_place) {  // to [token][head][Dp]
        for (int64_t t = 0; t < tb * it.heads; ++t) {
          const int64_t src = (t / it.heads) * token_stride + (t % it.heads) * D;
          widen(kb + src, sc.k.data() + t * Dp, D);
          widen(vb + src, sc.v.data() + t * Dp, D);
          std::fill(sc.k.data() + t * Dp + D, sc.k.data() + (t + 1) * Dp, 0.0f);
          std::fill(sc.v.data() + t * Dp + D, sc.v.data() + (t + 1) * Dp, 0.0f);
        }
      }
      if (lanes) {
        const float* k = sc.k.data();
        const float* v = sc.v.data();
        int64_t stride = Dp;
        if constexpr (std::is_same_v<scalar_t, float>) {
          if (in_place) k = kb, v = vb, stride = token_stride;
        }
        switch (rp / W) {
          case 1: lane_block<1>(k, v, stride, t0, tb, rows, sc); break;
          case 2: lane_block<2>(k, v, stride, t0, tb, rows, sc); break;
          case 3: lane_block<3>(k, v, stride, t0, tb, rows, sc); break;
          default: lane_block<4>(k, v, stride, t0, tb, rows, sc); break;
        }
      } else if (in_place) {
        row_block(kb, vb, token_stride, D, HG, t0, tb, rows, sc);
      } else {
        row_block<float>(sc.k.data(), sc.v.data(), it.heads * Dp, Dp, HG, t0, tb, rows, sc);
      }
    }

    for (int64_t r = 0; r < rows; ++r) {
      const float inv = 1.0f / sc.l[r];
      const float* acc = sc.acc.data() + r * Dp;
      scalar_t* dst = out + ((q0 + it.begin + r / HG) * Hq + it.head * G + r % HG) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[paired ? pair_order(d) : d] * inv);
    }
  }

  // Few rows: each row takes its dot products and online-softmax update on its own. Row r reads
  // the keys of head (r % HG) / G, head_stride apart.
  template <typename E>
  void row_block(const E* k, const E* v, int64_t stride, int64_t head_stride, int64_t HG, int64_t t0, int64_t tb,
                 int64_t rows, Scratch& sc) const {
    float* s = sc.scores.data();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = std::min<int64_t>(tb, int64_t(sc.pos[r]) + 1 - t0);  // causal: keys <= position
      if (n <= 0) continue;
      const float* qr = sc.q.data() + r * Dp;
      const E* kr = k + (r % HG) / G * head_stride;
      const int64_t np = round_up(n, W);
      vfloat mx = splat(sc.m[r]);
      for (int64_t c = 0; c < n; c += W) {  // W scores at a time
        const int64_t m = std::min<int64_t>(W, n - c);
        vfloat part[W];
        for (int64_t t = 0; t < m; ++t) part[t] = dot_lanes(qr, kr + (c + t) * stride, Dp);
        for (int64_t t = m; t < W; ++t) part[t] = vfloat{};
        vfloat scores = transpose_sum(part);
        if (m < W) scores = kLaneIndex < splat(float(m)) ? scores : splat(kNegInf);
        store(s + c, scores);
        mx = vmax(mx, scores);
      }
      const float m_new = hmax(mx);
      const float alpha = vexp(splat(sc.m[r] - m_new))[0];  // 0 on the first block (m = -inf)
      vfloat sum{};
      for (int64_t t = 0; t < np; t += W) {
        const vfloat p = vexp(load(s + t) - m_new);
        store(s + t, p);
        sum += p;
      }
      sc.m[r] = m_new;
      sc.l[r] = sc.l[r] * alpha + hsum(sum);
      pv(sc.acc.data() + r * Dp, alpha, s, 1, v + (r % HG) / G * head_stride, stride, n, Dp);
    }
  }

  // Many rows: RV vectors of rows in lanes; q is transposed to [D][RV * W].
  template <int RV>
  void lane_block(const float* k, const float* v, int64_t stride, int64_t t0, int64_t tb, int64_t rows,
                  Scratch& sc) const {
    constexpr int64_t rp = RV * W;
    float* s = sc.scores.data();  // [tb][rp]
    vfloat pos[RV];
    for (int rv = 0; rv < RV; ++rv) pos[rv] = load(sc.pos.data() + rv * W);
    int64_t t = 0;
    for (; t + 2 <= tb; t += 2) lane_scores<RV, 2>(sc.q.data(), rp, k + t * stride, stride, D, s + t * rp, t0 + t, pos);
    if (t < tb) lane_scores<RV, 1>(sc.q.data(), rp, k + t * stride, stride, D, s + t * rp, t0 + t, pos);
    for (int rv = 0; rv < RV; ++rv) {
      const vfloat m = load(sc.m.data() + rv * W);
      vfloat mx = m;
      for (t = 0; t < tb; ++t) mx = vmax(mx, load(s + t * rp + rv * W));
      const vfloat alpha = vexp(m - mx);
      vfloat sum{};
      for (t = 0; t < tb; ++t) {
        const vfloat p = vexp(load(s + t * rp + rv * W) - mx);
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
            const at::Tensor& starts, double scale, at::Tensor& out) {
  const int64_t S = table.size(0), L = pool.size(2), Hkv = pool.size(3), Hq = q.size(1), D = q.size(2);
  const int64_t G = Hq / Hkv, tile = std::max<int64_t>(1, kMaxRowVecs * W / G);
  const PagedAttention<scalar_t> pa{q.data_ptr<scalar_t>(), pool.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                                    table.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(), starts.data_ptr<int32_t>(),
                                    table.size(1), L, Hq, Hkv, G, D, round_up(D, 2 * W), static_cast<float>(scale)};
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
  std::atomic<int64_t> next{0};
  const auto work = [&](int64_t, int64_t) {
    thread_local Scratch sc;
    sc.reserve(rows, pa.Dp, L, Hkv);
    for (int64_t i = next.fetch_add(1); i < int64_t(items.size()); i = next.fetch_add(1)) pa.run(items[i], sc);
  };
  int64_t cost = 0;
  for (const Item& it : items) cost += it.cost;
  const int64_t helpers = std::min(threads, cost / kMinCostPerThread);  // waking a thread has a price
  if (helpers > 1) {
    at::parallel_for(0, helpers, 1, work);
  } else {
    work(0, 1);
  }
}

void check_inputs(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& table, const at::Tensor& seq_lens,
                  const at::Tensor& starts) {
  TORCH_CHECK_VALUE(q.device().is_cpu() && pool.device().is_cpu() && table.device().is_cpu() &&
                        seq_lens.device().is_cpu() && starts.device().is_cpu(),
                    "paged_attention kernel: CPU tensors only");
  TORCH_CHECK_VALUE(q.dim() == 3 && pool.dim() == 5 && table.dim() == 2, "paged_attention: bad ranks");
  TORCH_CHECK_VALUE(q.is_contiguous() && pool.is_contiguous() && table.is_contiguous() &&
                        seq_lens.is_contiguous() && starts.is_contiguous(),
                    "paged_attention: tensors must be contiguous");
  TORCH_CHECK_VALUE(q.scalar_type() == pool.scalar_type(), "paged_attention: q and pool dtypes differ");
  TORCH_CHECK_VALUE(table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                        starts.scalar_type() == at::kInt,
                    "paged_attention: block_table, seq_lens and query_start_loc must be int32");
  const int64_t S = table.size(0), M = table.size(1), NB = pool.size(0), L = pool.size(2);
  TORCH_CHECK_VALUE(pool.size(1) == 2 && pool.size(4) == q.size(2), "paged_attention: pool shape does not match q");
  TORCH_CHECK_VALUE(q.size(1) % pool.size(3) == 0, "paged_attention: Hq must be a multiple of Hkv");
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
                           const at::Tensor& seq_lens, const at::Tensor& starts, double scale) {
  check_inputs(q, pool, table, seq_lens, starts);
  at::Tensor out = at::empty_like(q);
  if (q.scalar_type() == at::kFloat) {
    launch<float>(q, pool, table, seq_lens, starts, scale, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    launch<at::BFloat16>(q, pool, table, seq_lens, starts, scale, out);
  } else {
    TORCH_CHECK_VALUE(false, "paged_attention: dtype must be float32 or bfloat16, got ", q.scalar_type());
  }
  return out;
}

void write_kv(at::Tensor& pool, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slots) {
  TORCH_CHECK_VALUE(pool.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && slots.device().is_cpu(),
                    "write_kv kernel: CPU tensors only");
  TORCH_CHECK_VALUE(pool.dim() == 5 && pool.size(1) == 2 && pool.is_contiguous(), "write_kv: bad pool");
  TORCH_CHECK_VALUE(k.is_contiguous() && v.is_contiguous() && slots.is_contiguous(),
                    "write_kv: tensors must be contiguous");
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
  at::parallel_for(0, T, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = s[t] / L, offset = s[t] % L;
      std::memcpy(dst + (block * 2 * L + offset) * bytes, ks + t * bytes, bytes);
      std::memcpy(dst + ((block * 2 + 1) * L + offset) * bytes, vs + t * bytes, bytes);
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels release the GIL: the engine runs on its own thread next to the HTTP server.
  m.def("paged_attention", &paged_attention, "Paged attention over the KV pool (docs/engine.md)",
        py::call_guard<py::gil_scoped_release>());
  m.def("write_kv", &write_kv, "Write k and v into the pool at slot_mapping",
        py::call_guard<py::gil_scoped_release>());
}
