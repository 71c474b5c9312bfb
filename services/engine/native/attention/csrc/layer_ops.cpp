// The elementwise steps of a decoder layer, one pass each over float32 or bf16 rows, with the
// roundings of the torch ops they replace (each op's result rounded to the tensor's dtype), so
// they agree with the plain-torch path to the last bit but for exp's own rounding in SiLU.
#include "layer_ops.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "vec.h"

namespace kvmesh {
namespace {

constexpr int64_t kGrain = 16;  // rows per task: small layers are not worth a second thread

// out[i] = f(in[i]...) for i < n, W at a time; the tail goes through a zero-padded vector.
template <typename T, typename F, typename... In>
HOT inline void map(T* out, int64_t n, F f, const In*... in) {
  int64_t i = 0;
  for (; i + W <= n; i += W) store_float(out + i, f(load_float(in + i)...));
  if (i == n) return;
  const auto padded = [&](const T* p) {
    std::array<T, W> v{};
    std::copy(p + i, p + n, v.begin());
    return load_float(v.data());
  };
  T tail[W];
  store_float(tail, f(padded(in)...));
  std::copy(tail, tail + (n - i), out + i);
}

template <typename T>
HOT inline float sum_of_squares(const T* x, int64_t n) {
  vfloat squares{};
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const vfloat v = load_float(x + i);
    squares += v * v;
  }
  float sum = 0.0f;
  for (int lane = 0; lane < W; ++lane) sum += squares[lane];
  for (; i < n; ++i) sum += float(x[i]) * float(x[i]);
  return sum;
}

template <typename T>
void rms_norm_rows(const T* x, int64_t stride, const T* w, T* y, int64_t rows, int64_t H, float eps) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + r * stride;
      const float inv = 1.0f / std::sqrt(sum_of_squares(row, H) / float(H) + eps);
      map(y + r * H, H, [&](vfloat v, vfloat g) { return rounded<T>(g * rounded<T>(v * inv)); }, row, w);
    }
  });
}

template <typename T>
void rotary_rows(const T* x, int64_t stride, const T* cos, const T* sin, T* out, int64_t T_, int64_t H, int64_t D) {
  const int64_t half = D / 2;
  at::parallel_for(0, T_, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t h = 0; h < H; ++h) {
        const T* a = x + t * stride + h * D;  // first half; roll(x, D / 2) swaps the halves
        T* o = out + (t * H + h) * D;
        const auto rotate = [](vfloat v, vfloat rolled, vfloat cv, vfloat sv) {
          return rounded<T>(rounded<T>(v * cv) + rounded<T>(rolled * sv));
        };
        map(o, half, rotate, a, a + half, c, s);
        map(o + half, half, rotate, a + half, a, c + half, s + half);
      }
    }
  });
}

template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      map(out + r * I, I, [](vfloat g, vfloat u) {
        // sigmoid(g) from e = exp(-|g|) <= 1, the range vexp covers
        const vfloat zero{}, one = splat(1.0f), e = vexp(g < zero ? g : -g);
        const vfloat sigmoid = (g < zero ? e : one) / (one + e);
        return rounded<T>(rounded<T>(g * sigmoid) * u);
      }, x + r * 2 * I, x + r * 2 * I + I);
    }
  });
}

// Calls f(T{}) with T the element type of x, float or at::BFloat16, which it checks.
template <typename F>
void dispatch(const at::Tensor& x, const char* name, F f) {
  TORCH_CHECK_VALUE(x.device().is_cpu(), name, ": CPU tensors only");
  if (x.scalar_type() == at::kFloat) {
    f(float{});
  } else if (x.scalar_type() == at::kBFloat16) {
    f(at::BFloat16{});
  } else {
    TORCH_CHECK_VALUE(false, name, ": dtype must be float32 or bfloat16, got ", x.scalar_type());
  }
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.stride(1) == 1 && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                        weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
                    "rms_norm: x must be [T, H] with contiguous rows and weight [H] of its dtype");
  at::Tensor y = at::empty(x.sizes(), x.options());
  dispatch(x, "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    rms_norm_rows(x.data_ptr<scalar_t>(), x.stride(0), weight.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(),
                  x.size(0), x.size(1), float(eps));
  });
  return y;
}

at::Tensor rotary(const at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t T = qk.size(0), D = qk.dim() == 3 ? qk.size(2) : 0;
  TORCH_CHECK_VALUE(qk.dim() == 3 && D % 2 == 0 && qk.stride(2) == 1 && qk.stride(1) == D,
                    "rotary: qk must be [T, H, D] with D even and each token's heads contiguous");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK_VALUE(t->sizes() == at::IntArrayRef({T, 1, D}) && t->is_contiguous() &&
                          t->scalar_type() == qk.scalar_type(),
                      "rotary: cos and sin must be contiguous [T, 1, D] of qk's dtype");
  at::Tensor out = at::empty(qk.sizes(), qk.options());
  dispatch(qk, "rotary", [&](auto tag) {
    using scalar_t = decltype(tag);
    rotary_rows(qk.data_ptr<scalar_t>(), qk.stride(0), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                out.data_ptr<scalar_t>(), T, qk.size(1), D);
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK_VALUE(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.is_contiguous(),
                    "silu_mul: gate_up must be contiguous [T, 2I]");
  const int64_t I = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), I}, gate_up.options());
  dispatch(gate_up, "silu_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    silu_mul_rows(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.size(0), I);
  });
  return out;
}

}  // namespace kvmesh
