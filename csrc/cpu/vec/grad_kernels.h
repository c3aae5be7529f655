// The per-chunk kernels behind accel::unscale_grads_ and accel::clip_grads_, compiled once per instruction set.
//
// grad_kernels.cpp is built three times (setup.py: DEFAULT, AVX2, AVX512) with CPU_CAPABILITY naming a
// different namespace each time, so at::vec's Vectorized<T> is 8, 16 or 32 lanes wide in each copy; each copy
// exports one GradKernels table and grad_unscale.cpp picks the one torch itself uses (isa_tables.h). This header is
// shared by both sides, so it holds plain types only.
#pragma once

#include <cstdint>

namespace accel::cpu {

// The dtypes the kernels handle; anything else goes through the Python reference.
enum class GradDtype : int { Float = 0, Half = 1, BFloat16 = 2, Count = 3 };

struct ChunkStats {
  double sum_sq;    // sum of squares of the unscaled values, in fp32 before any narrowing (fp32 lanes, then fp64)
  bool non_finite;  // an inf or nan was read (before unscaling, as torch checks)
};

// Multiplies data[0, n) by inv_scale in fp32 and stores the result in the element's dtype, as
// torch._amp_foreach_non_finite_check_and_unscale_ does; with inv_scale == 1 it only reads.
using UnscaleChunkFn = ChunkStats (*)(void* data, int64_t n, float inv_scale);
// data[0, n) *= factor, computed in fp32 and rounded to the element's dtype (as torch's mul_ with an fp32 scalar).
using ScaleChunkFn = void (*)(void* data, int64_t n, float factor);

struct GradKernels {
  const char* isa;
  UnscaleChunkFn unscale[static_cast<int>(GradDtype::Count)];
  ScaleChunkFn scale[static_cast<int>(GradDtype::Count)];
};

extern const GradKernels grad_kernels_ACCEL_DEFAULT;
#if defined(ACCEL_CPU_AVX2)
extern const GradKernels grad_kernels_ACCEL_AVX2;
#endif
#if defined(ACCEL_CPU_AVX512)
extern const GradKernels grad_kernels_ACCEL_AVX512;
// The AVX512 kernels with bf16 narrowed by AVX512-BF16's instruction (one per 32 values instead of ~16 integer
// operations); only for CPUs that have it (avx512_bf16_supported, isa_tables.h).
extern const GradKernels grad_kernels_ACCEL_AVX512_BF16;
#endif

}  // namespace accel::cpu
