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
struct Accumulator {
  FloatVec sum_sq = FloatVec(0.0f);
  FloatVec probe = FloatVec(0.0f);

  void read(const FloatVec& raw, const FloatVec& stored) {
    probe = probe + (raw - raw);
    sum_sq = at::vec::fmadd(stored, stored, sum_sq);
  }

  ChunkStats result() const {
    alignas(64) float lanes[FloatVec::size()];
    alignas(64) float probes[FloatVec::size()];
    sum_sq.store(lanes);
    probe.store(probes);
    ChunkStats stats{0.0, false};
    for (int i = 0; i < FloatVec::size(); ++i) {
      stats.sum_sq += lanes[i];
      stats.non_finite |= probes[i] != 0.0f;  // nan != 0
    }
    return stats;
  }
};

ChunkStats unscale_float(void* data, int64_t n, float inv_scale) {
  auto* p = static_cast<float*>(data);
  const FloatVec scale(inv_scale);
  const bool read_only = inv_scale == 1.0f;  // torch returns the value itself then; x * 1 == x anyway
  Accumulator acc;
  for (int64_t i = 0; i < n; i += FloatVec::size()) {
    const int64_t count = std::min<int64_t>(FloatVec::size(), n - i);
    const FloatVec x = FloatVec::loadu(p + i, count);  // the missing lanes read as 0
    if (read_only) {
      acc.read(x, x);
      continue;
    }
    const FloatVec y = x * scale;
    y.store(p + i, count);
    acc.read(x, y);
  }
  return acc.result();
}

// fp16 / bf16: widen to two fp32 vectors, compute there, narrow back. The sum of squares reads the narrowed
// values, i.e. the gradient as it is stored, which is what clip_grad_norm_ would read.
template <typename T>
ChunkStats unscale_reduced(void* data, int64_t n, float inv_scale) {
  using HalfVec = Vectorized<T>;
  auto* p = static_cast<T*>(data);
  const FloatVec scale(inv_scale);
  const bool read_only = inv_scale == 1.0f;
  Accumulator acc;
  for (int64_t i = 0; i < n; i += HalfVec::size()) {
    const int64_t count = std::min<int64_t>(HalfVec::size(), n - i);
    const HalfVec h = HalfVec::loadu(p + i, count);
    auto [lo, hi] = at::vec::convert_to_float<T>(h);
    if (read_only) {
      acc.read(lo, lo);
      acc.read(hi, hi);
      continue;
    }
    const HalfVec out = at::vec::convert_from_float<T>(lo * scale, hi * scale);
    out.store(p + i, count);
    auto [out_lo, out_hi] = at::vec::convert_to_float<T>(out);
    acc.read(lo, out_lo);
    acc.read(hi, out_hi);
  }
  return acc.result();
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
