// Vectorized chunk kernels for the fused gradient unscale and clip; see grad_kernels.h for how this file is
// built once per instruction set. Only at::vec and plain pointers here: every inline function this file makes
// the compiler emit is compiled for this file's instruction set, so nothing torch-side that other files share
// (Tensor, dispatcher) is pulled in.
#include "grad_kernels.h"

#include <ATen/cpu/vec/functional.h>  // convert_to_float / convert_from_float
#include <ATen/cpu/vec/vec.h>

#include <algorithm>

#ifndef CPU_CAPABILITY
#error "grad_kernels.cpp is compiled by setup.py with -DCPU_CAPABILITY=ACCEL_<isa>"
#endif

namespace accel::cpu {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;
using FloatVec = Vectorized<float>;

// Why x - x: it is 0 for every finite x and nan for inf and nan, so one add per vector keeps a running
// "anything non-finite?" without compares or masks. (Valid because we never build with -ffinite-math-only.)
// Two independent sets of accumulators: a single fma/add chain would make every vector wait for the previous
// one's result (4 cycles), which costs fp16/bf16, where each element is cheap to load, a third of its speed.
struct Accumulator {
  FloatVec sum_sq[2] = {FloatVec(0.0f), FloatVec(0.0f)};
  FloatVec probe[2] = {FloatVec(0.0f), FloatVec(0.0f)};

  void read(int k, const FloatVec& raw, const FloatVec& unscaled) {
    probe[k] = probe[k] + (raw - raw);
    sum_sq[k] = at::vec::fmadd(unscaled, unscaled, sum_sq[k]);
  }

  ChunkStats result() const {
    alignas(64) float lanes[FloatVec::size()];
    alignas(64) float probes[FloatVec::size()];
    (sum_sq[0] + sum_sq[1]).store(lanes);
    (probe[0] + probe[1]).store(probes);
    ChunkStats stats{0.0, false};
    for (int i = 0; i < FloatVec::size(); ++i) {
      stats.sum_sq += lanes[i];
      stats.non_finite |= probes[i] != 0.0f;  // nan != 0
    }
    return stats;
  }
};

// Vector k of a float chunk: loaded, unscaled (unless read-only), stored, accumulated. The missing lanes of a
// partial vector read as 0 and are not stored.
template <bool kReadOnly>
inline void unscale_float_vector(float* p, int64_t count, const FloatVec& scale, Accumulator& acc, int k) {
  const FloatVec x = FloatVec::loadu(p, count);
  if (kReadOnly) {
    acc.read(k, x, x);
    return;
  }
  const FloatVec y = x * scale;
  y.store(p, count);
  acc.read(k, x, y);
}

template <bool kReadOnly>
ChunkStats unscale_float_impl(float* p, int64_t n, float inv_scale) {
  constexpr int64_t kWidth = FloatVec::size();
  const FloatVec scale(inv_scale);
  Accumulator acc;
  int64_t i = 0;
  for (; i + 2 * kWidth <= n; i += 2 * kWidth) {
    unscale_float_vector<kReadOnly>(p + i, kWidth, scale, acc, 0);
    unscale_float_vector<kReadOnly>(p + i + kWidth, kWidth, scale, acc, 1);
  }
  for (; i < n; i += kWidth) unscale_float_vector<kReadOnly>(p + i, std::min(kWidth, n - i), scale, acc, 0);
  return acc.result();
}

ChunkStats unscale_float(void* data, int64_t n, float inv_scale) {
  auto* p = static_cast<float*>(data);
  // torch returns the value itself for inv_scale == 1 (x * 1 == x anyway): then nothing needs writing.
  return inv_scale == 1.0f ? unscale_float_impl<true>(p, n, inv_scale) : unscale_float_impl<false>(p, n, inv_scale);
}

// fp16 / bf16: widen to two fp32 vectors, compute there, narrow back. The sum of squares reads the fp32 products
// before they are narrowed: narrowing them back to fp32 just to square them would cost two more conversions per
// vector, for a difference far below the norm's own rounding.
template <typename T, bool kReadOnly>
ChunkStats unscale_reduced_impl(T* p, int64_t n, float inv_scale) {
  using HalfVec = Vectorized<T>;
  const FloatVec scale(inv_scale);
  Accumulator acc;
  for (int64_t i = 0; i < n; i += HalfVec::size()) {
    const int64_t count = std::min<int64_t>(HalfVec::size(), n - i);
    auto [lo, hi] = at::vec::convert_to_float<T>(HalfVec::loadu(p + i, count));
    if (kReadOnly) {
      acc.read(0, lo, lo);
      acc.read(1, hi, hi);
      continue;
    }
    const FloatVec out_lo = lo * scale, out_hi = hi * scale;
    at::vec::convert_from_float<T>(out_lo, out_hi).store(p + i, count);
    acc.read(0, lo, out_lo);
    acc.read(1, hi, out_hi);
  }
  return acc.result();
}

template <typename T>
ChunkStats unscale_reduced(void* data, int64_t n, float inv_scale) {
  auto* p = static_cast<T*>(data);
  return inv_scale == 1.0f ? unscale_reduced_impl<T, true>(p, n, inv_scale)
                           : unscale_reduced_impl<T, false>(p, n, inv_scale);
}

void scale_float(void* data, int64_t n, float factor) {
  auto* p = static_cast<float*>(data);
  const FloatVec f(factor);
  for (int64_t i = 0; i < n; i += FloatVec::size()) {
    const int64_t count = std::min<int64_t>(FloatVec::size(), n - i);
    (FloatVec::loadu(p + i, count) * f).store(p + i, count);
  }
}

template <typename T>
void scale_reduced(void* data, int64_t n, float factor) {
  using HalfVec = Vectorized<T>;
  auto* p = static_cast<T*>(data);
  const FloatVec f(factor);
  for (int64_t i = 0; i < n; i += HalfVec::size()) {
    const int64_t count = std::min<int64_t>(HalfVec::size(), n - i);
    auto [lo, hi] = at::vec::convert_to_float<T>(HalfVec::loadu(p + i, count));
    at::vec::convert_from_float<T>(lo * f, hi * f).store(p + i, count);
  }
}

}  // namespace
}  // namespace CPU_CAPABILITY

#define ACCEL_PASTE_(a, b) a##b
#define ACCEL_PASTE(a, b) ACCEL_PASTE_(a, b)
#define ACCEL_STRINGIFY_(x) #x
#define ACCEL_STRINGIFY(x) ACCEL_STRINGIFY_(x)

extern const GradKernels ACCEL_PASTE(grad_kernels_, CPU_CAPABILITY) = {
    ACCEL_STRINGIFY(CPU_CAPABILITY),
    {CPU_CAPABILITY::unscale_float, CPU_CAPABILITY::unscale_reduced<c10::Half>,
     CPU_CAPABILITY::unscale_reduced<c10::BFloat16>},
    {CPU_CAPABILITY::scale_float, CPU_CAPABILITY::scale_reduced<c10::Half>,
     CPU_CAPABILITY::scale_reduced<c10::BFloat16>},
};

}  // namespace accel::cpu
