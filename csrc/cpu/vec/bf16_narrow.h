// How fp32 results are rounded back to fp16 / bf16 in the per-instruction-set kernels of this folder. Include it
// only from a file compiled with -DCPU_CAPABILITY=ACCEL_<isa> (setup.py builds cpu/vec/*.cpp that way): its
// types live in that copy's namespace.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

#ifndef CPU_CAPABILITY
#error "bf16_narrow.h belongs to files compiled with -DCPU_CAPABILITY=ACCEL_<isa>"
#endif

namespace accel::cpu {
namespace CPU_CAPABILITY {

// at::vec's conversion: the same rounding as torch's own kernels.
struct AtenNarrow {
  template <typename T>
  static at::vec::Vectorized<T> narrow(const at::vec::Vectorized<float>& lo, const at::vec::Vectorized<float>& hi) {
    return at::vec::convert_from_float<T>(lo, hi);
  }
};

#if defined(CPU_CAPABILITY_AVX512)
// at::vec narrows fp32 to bf16 with integer arithmetic (round-to-nearest-even by hand, a NaN fix-up, a pack and a
// permute: ~16 operations per 32 values), which bounds any pass that writes bf16; AVX512-BF16 has one instruction
// with the same rounding. It differs in two places: it flushes denormal inputs to zero (a vector holding one takes
// at::vec's path instead, so results stay bit-identical to torch's) and it writes a NaN's own payload (torch
// writes 0xffff; NaN payloads are not part of any contract here). Functions using it need ACCEL_BF16_TARGET, and
// `flatten` so that the loops around it are compiled for that target too.
#define ACCEL_BF16_TARGET __attribute__((target("avx512bf16")))

struct HardwareBf16Narrow {
  template <typename T>
  ACCEL_BF16_TARGET static at::vec::Vectorized<T> narrow(const at::vec::Vectorized<float>& lo,
                                                         const at::vec::Vectorized<float>& hi) {
    static_assert(std::is_same_v<T, c10::BFloat16>, "only bf16 has a narrowing instruction here");
    constexpr int kDenormal = 0x20;  // vfpclassps category
    if (_mm512_fpclass_ps_mask(lo, kDenormal) | _mm512_fpclass_ps_mask(hi, kDenormal)) {
      return at::vec::convert_from_float<T>(lo, hi);
    }
    return at::vec::Vectorized<T>(reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));  // lo: the low half
  }
};
#endif

}  // namespace CPU_CAPABILITY
}  // namespace accel::cpu
