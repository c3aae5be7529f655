// The elementwise reductions behind accel's shared-memory process group (shm_bindings/shm_process_group.cpp) and
// accel::reduce_in_order_, compiled once per instruction set as grad_kernels.cpp is (see grad_kernels.h):
// reduce_kernels.cpp is built three times (DEFAULT, AVX2, AVX512), each copy exports one ReduceKernels table, and
// cpu/reduce_in_order.cpp picks the one torch itself runs with. Shared by both sides, so plain types only.
#pragma once

#include <cstdint>

namespace accel::cpu {

// The dtypes with kernels; anything else is left to the caller (the process group hands it to gloo).
enum class ReduceDtype : int { Float, Double, Half, BFloat16, Int8, UInt8, Int16, Int32, Int64, Bool, Count };

// torch.distributed's ReduceOp, in its numbering (SUM = 0 ... PREMUL_SUM = 8).
enum class ReduceKind : int { Sum, Avg, Product, Min, Max, BitAnd, BitOr, BitXor, PremulSum, Count };

// out[i] = parts[0][i] op parts[1][i] op ... op parts[count - 1][i] for i in [begin, end), combined strictly left
// to right: the order never depends on the vector width, the thread split or the caller, so every rank that runs
// a kernel on the same parts gets the same bits.
//  - fp16 / bf16 widen to fp32, combine there and round once at the end (sum, avg, product, premul_sum).
//  - avg divides the sum by `count`; premul_sum multiplies the sum by `factor` (see reduce_kernels.cpp for why not
//    each part, as NCCL does: the same value up to rounding).
//  - integers wrap as two's complement; bool is a logical or (sum, max, bor), and (product, min, band) or xor.
//  - min / max propagate NaN (torch.minimum / torch.maximum).
// `out` may be one of the parts (the same pointer), never a partial overlap of one.
using ReduceFn = void (*)(const void* const* parts, int count, void* out, int64_t begin, int64_t end, double factor);

struct ReduceKernels {
  const char* isa;
  // nullptr where the combination has no meaning (avg of integers, bitwise ops on floating point).
  ReduceFn fn[static_cast<int>(ReduceKind::Count)][static_cast<int>(ReduceDtype::Count)];
};

extern const ReduceKernels reduce_kernels_ACCEL_DEFAULT;
#if defined(ACCEL_CPU_AVX2)
extern const ReduceKernels reduce_kernels_ACCEL_AVX2;
#endif
#if defined(ACCEL_CPU_AVX512)
extern const ReduceKernels reduce_kernels_ACCEL_AVX512;
// bf16 results rounded by AVX512-BF16's instruction (see bf16_narrow.h); only where avx512_bf16_supported().
extern const ReduceKernels reduce_kernels_ACCEL_AVX512_BF16;
#endif

}  // namespace accel::cpu
