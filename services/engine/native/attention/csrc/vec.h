// Float vectors of the widest width -march allows (GCC/Clang vector extensions), shared by the
// CPU kernels, and their conversions from and to bf16.
#pragma once

#include <c10/util/BFloat16.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#define HOT [[gnu::always_inline]]  // hot-loop helpers must inline whatever the optimiser thinks

namespace kvmesh {

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

// W elements as floats, and back; to bf16 rounds to nearest even and keeps NaN a NaN.
typedef uint16_t vhalf __attribute__((vector_size(W * sizeof(uint16_t))));
typedef uint32_t vuint __attribute__((vector_size(W * sizeof(uint32_t))));
HOT inline vfloat load_float(const float* p) { return load(p); }
HOT inline vfloat load_float(const at::BFloat16* p) {
  vhalf h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<vfloat>(__builtin_convertvector(h, vuint) << 16);
}
HOT inline vuint bf16_bits(vfloat v) {  // in the high halves
  const vuint bits = reinterpret_cast<vuint>(v);
  const vuint rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  return v == v ? rounded : vuint{} + 0x7FC00000u;
}
HOT inline void store_float(float* p, vfloat v) { store(p, v); }
HOT inline void store_float(at::BFloat16* p, vfloat v) {
  const vhalf h = __builtin_convertvector(bf16_bits(v) >> 16, vhalf);
  std::memcpy(p, &h, sizeof h);
}
// v rounded to T, as a T op's result is.
template <typename T>
HOT inline vfloat rounded(vfloat v) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    return reinterpret_cast<vfloat>(bf16_bits(v));
  } else {
    return v;
  }
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

// f(std::integral_constant<int, n>{}) for a runtime 1 <= n <= N.
template <int N, typename F>
HOT inline void with_constant(int n, F&& f) {
  if constexpr (N > 1) {
    if (n < N) return with_constant<N - 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// The first n lanes (mask) of a vector from and to float32 or bf16 memory; bf16 rounds to nearest even.
HOT inline vfloat load_first(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
HOT inline vfloat load_first(const at::BFloat16* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}
HOT inline void store_first(float* p, __mmask16 mask, vfloat v) { _mm512_mask_storeu_ps(p, mask, v); }
HOT inline void store_first(at::BFloat16* p, __mmask16 mask, vfloat v) {
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(reinterpret_cast<__m512i>(bf16_bits(v) >> 16)));
}
#endif

}  // namespace kvmesh
