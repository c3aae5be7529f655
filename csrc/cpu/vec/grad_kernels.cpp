// Vectorized chunk kernels for the fused gradient unscale and clip; see grad_kernels.h for how this file is
// built once per instruction set. Only at::vec and plain pointers here: every inline function this file makes
// the compiler emit is compiled for this file's instruction set, so nothing torch-side that other files share
// (Tensor, dispatcher) is pulled in.
#include "grad_kernels.h"
#include "isa_tables.h"

#include <ATen/cpu/vec/functional.h>  // convert_to_float / convert_from_float
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

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

// Runs `body` on the last `count` (< one vector) elements at `p` through a zeroed vector-sized buffer, so the
// missing lanes read as 0: Vectorized::loadu(ptr, count) leaves them undefined in older torch releases, and stray
// bits there would look like nan to the probe.
template <typename T, int64_t kWidth, typename Body>
inline void through_zeroed_buffer(T* p, int64_t count, bool write_back, const Body& body) {
  alignas(64) T buffer[kWidth];
  std::memset(static_cast<void*>(buffer), 0, sizeof(buffer));
  std::memcpy(static_cast<void*>(buffer), p, count * sizeof(T));
  body(buffer);
  if (write_back) std::memcpy(static_cast<void*>(p), buffer, count * sizeof(T));
}

// One full vector of a float chunk (set k of accumulators): loaded, unscaled (unless read-only), stored, accumulated.
template <bool kReadOnly>
inline void unscale_float_vector(float* p, const FloatVec& scale, Accumulator& acc, int k) {
  const FloatVec x = FloatVec::loadu(p);
  if (kReadOnly) {
    acc.read(k, x, x);
    return;
  }
  const FloatVec y = x * scale;
  y.store(p);
  acc.read(k, x, y);
}

template <bool kReadOnly>
ChunkStats unscale_float_impl(float* p, int64_t n, float inv_scale) {
  constexpr int64_t kWidth = FloatVec::size();
  const FloatVec scale(inv_scale);
  Accumulator acc;
  int64_t i = 0;
  for (; i + 2 * kWidth <= n; i += 2 * kWidth) {
    unscale_float_vector<kReadOnly>(p + i, scale, acc, 0);
    unscale_float_vector<kReadOnly>(p + i + kWidth, scale, acc, 1);
  }
  for (; i + kWidth <= n; i += kWidth) unscale_float_vector<kReadOnly>(p + i, scale, acc, 0);
  if (i < n) {
    through_zeroed_buffer<float, kWidth>(p + i, n - i, !kReadOnly, [&](float* buffer) {
      unscale_float_vector<kReadOnly>(buffer, scale, acc, 0);
    });
  }
  return acc.result();
}

ChunkStats unscale_float(void* data, int64_t n, float inv_scale) {
  auto* p = static_cast<float*>(data);
  // torch returns the value itself for inv_scale == 1 (x * 1 == x anyway): then nothing needs writing.
  return inv_scale == 1.0f ? unscale_float_impl<true>(p, n, inv_scale) : unscale_float_impl<false>(p, n, inv_scale);
}

// How fp32 results are narrowed back to fp16 / bf16: at::vec's conversion (the same rounding as torch's kernels).
struct AtenNarrow {
  template <typename T>
  static Vectorized<T> narrow(const FloatVec& lo, const FloatVec& hi) {
    return at::vec::convert_from_float<T>(lo, hi);
  }
};

// fp16 / bf16: widen to two fp32 vectors, compute there, narrow back. The sum of squares reads the fp32 products
// before they are narrowed: narrowing them back to fp32 just to square them would cost two more conversions per
// vector, for a difference far below the norm's own rounding.
template <typename T, bool kReadOnly, typename Narrow>
inline void unscale_reduced_vector(T* p, const FloatVec& scale, Accumulator& acc) {
  auto [lo, hi] = at::vec::convert_to_float<T>(Vectorized<T>::loadu(p));
  if (kReadOnly) {
    acc.read(0, lo, lo);
    acc.read(1, hi, hi);
    return;
  }
  const FloatVec out_lo = lo * scale, out_hi = hi * scale;
  Narrow::template narrow<T>(out_lo, out_hi).store(p);
  acc.read(0, lo, out_lo);
  acc.read(1, hi, out_hi);
}

template <typename T, bool kReadOnly, typename Narrow>
ChunkStats unscale_reduced_impl(T* p, int64_t n, float inv_scale) {
  constexpr int64_t kWidth = Vectorized<T>::size();
  const FloatVec scale(inv_scale);
  Accumulator acc;
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) unscale_reduced_vector<T, kReadOnly, Narrow>(p + i, scale, acc);
  if (i < n) {
    through_zeroed_buffer<T, kWidth>(p + i, n - i, !kReadOnly, [&](T* buffer) {
      unscale_reduced_vector<T, kReadOnly, Narrow>(buffer, scale, acc);
    });
  }
  return acc.result();
}

template <typename T, typename Narrow = AtenNarrow>
ChunkStats unscale_reduced(void* data, int64_t n, float inv_scale) {
  auto* p = static_cast<T*>(data);
  return inv_scale == 1.0f ? unscale_reduced_impl<T, true, Narrow>(p, n, inv_scale)
                           : unscale_reduced_impl<T, false, Narrow>(p, n, inv_scale);
}

void scale_float(void* data, int64_t n, float factor) {
  constexpr int64_t kWidth = FloatVec::size();
  auto* p = static_cast<float*>(data);
  const FloatVec f(factor);
  auto scale_vector = [&](float* q) { (FloatVec::loadu(q) * f).store(q); };
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) scale_vector(p + i);
  if (i < n) through_zeroed_buffer<float, kWidth>(p + i, n - i, true, scale_vector);
}

template <typename T, typename Narrow = AtenNarrow>
void scale_reduced(void* data, int64_t n, float factor) {
  constexpr int64_t kWidth = Vectorized<T>::size();
  auto* p = static_cast<T*>(data);
  const FloatVec f(factor);
  auto scale_vector = [&](T* q) {
    auto [lo, hi] = at::vec::convert_to_float<T>(Vectorized<T>::loadu(q));
    Narrow::template narrow<T>(lo * f, hi * f).store(q);
  };
  int64_t i = 0;
  for (; i + kWidth <= n; i += kWidth) scale_vector(p + i);
  if (i < n) through_zeroed_buffer<T, kWidth>(p + i, n - i, true, scale_vector);
}

#if defined(CPU_CAPABILITY_AVX512)
// Why bf16 was the slow dtype: at::vec narrows fp32 to bf16 with integer arithmetic (round-to-nearest-even by
// hand, a NaN fix-up, a pack and a permute: ~16 operations per 32 values), so each of the unscale's and the
// clip's passes was bound by it, not by memory. AVX512-BF16 has one instruction for it, with the same rounding.
// It differs in two places: it flushes denormal inputs to zero (torch rounds them: a vector holding one takes
// at::vec's path, so results stay bit-identical) and it writes a NaN's own payload (torch writes 0xffff; NaN
// payloads are not part of the contract, and a NaN skips the step anyway).
#define ACCEL_BF16_TARGET __attribute__((target("avx512bf16")))

struct HardwareBf16Narrow {
  template <typename T>
  ACCEL_BF16_TARGET static Vectorized<T> narrow(const FloatVec& lo, const FloatVec& hi) {
    static_assert(std::is_same_v<T, c10::BFloat16>, "only bf16 has a narrowing instruction here");
    constexpr int kDenormal = 0x20;  // vfpclassps category
    if (_mm512_fpclass_ps_mask(lo, kDenormal) | _mm512_fpclass_ps_mask(hi, kDenormal)) {
      return at::vec::convert_from_float<T>(lo, hi);
    }
    return Vectorized<T>(reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));  // lo lands in the low half
  }
};

// flatten: the loop templates are inlined into these, so the narrowing instruction is too (a function compiled
// without the avx512bf16 target cannot inline one compiled with it).
ACCEL_BF16_TARGET __attribute__((flatten)) ChunkStats unscale_bf16_hardware(void* data, int64_t n, float inv_scale) {
  return unscale_reduced<c10::BFloat16, HardwareBf16Narrow>(data, n, inv_scale);
}

ACCEL_BF16_TARGET __attribute__((flatten)) void scale_bf16_hardware(void* data, int64_t n, float factor) {
  scale_reduced<c10::BFloat16, HardwareBf16Narrow>(data, n, factor);
}
#endif

}  // namespace
}  // namespace CPU_CAPABILITY

// constinit: built by the compiler, not by this copy's (AVX-512 / AVX2) code at load time (see reduce_kernels.cpp).
extern constinit const GradKernels ACCEL_THIS_ISA_TABLE(grad_kernels_) = {
    ACCEL_THIS_ISA_NAME,
    {CPU_CAPABILITY::unscale_float, CPU_CAPABILITY::unscale_reduced<c10::Half>,
     CPU_CAPABILITY::unscale_reduced<c10::BFloat16>},
    {CPU_CAPABILITY::scale_float, CPU_CAPABILITY::scale_reduced<c10::Half>,
     CPU_CAPABILITY::scale_reduced<c10::BFloat16>},
};

#if defined(CPU_CAPABILITY_AVX512)
extern constinit const GradKernels grad_kernels_ACCEL_AVX512_BF16 = {
    "ACCEL_AVX512_BF16",
    {CPU_CAPABILITY::unscale_float, CPU_CAPABILITY::unscale_reduced<c10::Half>, CPU_CAPABILITY::unscale_bf16_hardware},
    {CPU_CAPABILITY::scale_float, CPU_CAPABILITY::scale_reduced<c10::Half>, CPU_CAPABILITY::scale_bf16_hardware},
};

bool avx512_bf16_supported() {
  return __builtin_cpu_supports("avx512bf16");
}
#endif

}  // namespace accel::cpu
