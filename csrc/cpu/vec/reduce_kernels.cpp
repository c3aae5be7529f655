// Vectorized fixed-order reductions of several equally long arrays into one; see reduce_kernels.h for the
// contract and for how this file is built once per instruction set. Only at::vec and plain pointers here.
//
// Each kernel walks the arrays one vector at a time and, for that vector, folds part 0, 1, ..., count - 1 into
// an accumulator held in registers before storing it once: every input byte is read once and every output byte
// written once, whatever the number of parts (DeepSpeed's shared-memory all-reduce reduces the same way, one
// pass over all ranks' buffers, in deepspeed/csrc/cpu/comm/shm.cpp; its kernels are per dtype and per rank
// count, these are per dtype and op for any count). The last partial vector goes through the same code with
// partial loads and stores, so it is combined exactly as a full one would be.
#include "isa_tables.h"
#include "reduce_kernels.h"

#include "bf16_narrow.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

#ifndef CPU_CAPABILITY
#error "reduce_kernels.cpp is compiled by setup.py with -DCPU_CAPABILITY=ACCEL_<isa>"
#endif

namespace accel::cpu {
namespace CPU_CAPABILITY {
namespace {

using at::vec::Vectorized;
using FloatVec = Vectorized<float>;

// --- what one vector of elements looks like while it is being combined -----------------------------------------

// Types that combine in their own width: one at::vec vector per step.
template <typename T>
struct Native {
  using Element = T;
  using Scalar = T;  // the type a premul factor and an avg divisor take
  static constexpr int64_t kWidth = Vectorized<T>::size();
  Vectorized<T> v;

  static Native load(const T* p, int64_t n) { return {n == kWidth ? Vectorized<T>::loadu(p) : Vectorized<T>::loadu(p, n)}; }
  void store(T* p, int64_t n) const { v.store(p, static_cast<int>(n)); }
  template <typename Op>
  void combine(const Native& other, Op op) { v = op(v, other.v); }
  void scale(Scalar factor) { v = v * Vectorized<T>(factor); }
  void divide(Scalar divisor) { v = v / Vectorized<T>(divisor); }
};

// fp16 / bf16: one vector of the narrow type is two fp32 vectors while it is combined, rounded once when stored.
template <typename T, typename Narrow>
struct Widened {
  using Element = T;
  using Scalar = float;
  static constexpr int64_t kWidth = Vectorized<T>::size();
  FloatVec lo, hi;

  static Widened load(const T* p, int64_t n) {
    auto [lo, hi] = at::vec::convert_to_float<T>(n == kWidth ? Vectorized<T>::loadu(p) : Vectorized<T>::loadu(p, n));
    return {lo, hi};
  }
  void store(T* p, int64_t n) const { Narrow::template narrow<T>(lo, hi).store(p, static_cast<int>(n)); }
  template <typename Op>
  void combine(const Widened& other, Op op) {
    lo = op(lo, other.lo);
    hi = op(hi, other.hi);
  }
  void scale(float factor) {
    lo = lo * FloatVec(factor);
    hi = hi * FloatVec(factor);
  }
  void divide(float divisor) {
    lo = lo / FloatVec(divisor);
    hi = hi / FloatVec(divisor);
  }
};

// --- the combining operations -----------------------------------------------------------------------------------

struct Add {
  template <typename V> V operator()(const V& a, const V& b) const { return a + b; }
};
struct Multiply {
  template <typename V> V operator()(const V& a, const V& b) const { return a * b; }
};
struct Minimum {
  template <typename V> V operator()(const V& a, const V& b) const { return at::vec::minimum(a, b); }
};
struct Maximum {
  template <typename V> V operator()(const V& a, const V& b) const { return at::vec::maximum(a, b); }
};
struct BitAnd {
  template <typename V> V operator()(const V& a, const V& b) const { return a & b; }
};
struct BitOr {
  template <typename V> V operator()(const V& a, const V& b) const { return a | b; }
};
struct BitXor {
  template <typename V> V operator()(const V& a, const V& b) const { return a ^ b; }
};

// What happens to the result before it is stored: avg divides by the count, premul_sum multiplies by the factor.
// premul_sum scales the sum rather than each part (NCCL's order) because a multiply feeding an add is what the
// compiler contracts into one fused multiply-add in the AVX2/AVX512 builds (GCC's default -ffp-contract=fast), which
// rounds differently from torch's separate operations and from the DEFAULT build; scaling once keeps every build
// and torch's reference in agreement, for one multiply per element instead of one per part.
enum class Extra { None, Average, Scale };

template <typename Lanes, typename Op, Extra kExtra>
inline void reduce_vector(const typename Lanes::Element* const* parts, int count, typename Lanes::Element* out,
                          int64_t at, int64_t n, typename Lanes::Scalar factor) {
  Lanes acc = Lanes::load(parts[0] + at, n);
  for (int r = 1; r < count; ++r) acc.combine(Lanes::load(parts[r] + at, n), Op{});
  if (kExtra == Extra::Average) acc.divide(static_cast<typename Lanes::Scalar>(count));
  if (kExtra == Extra::Scale) acc.scale(factor);
  acc.store(out + at, n);
}

template <typename Lanes, typename Op, Extra kExtra = Extra::None>
void reduce_parts(const void* const* parts, int count, void* out, int64_t begin, int64_t end, double factor) {
  using T = typename Lanes::Element;
  const auto* const* p = reinterpret_cast<const T* const*>(parts);
  auto* o = static_cast<T*>(out);
  const auto scalar = static_cast<typename Lanes::Scalar>(factor);
  int64_t i = begin;
  for (; i + Lanes::kWidth <= end; i += Lanes::kWidth) reduce_vector<Lanes, Op, kExtra>(p, count, o, i, Lanes::kWidth, scalar);
  if (i < end) reduce_vector<Lanes, Op, kExtra>(p, count, o, i, end - i, scalar);
}

// --- the table ----------------------------------------------------------------------------------------------------

constexpr int kKinds = static_cast<int>(ReduceKind::Count);
constexpr int kDtypes = static_cast<int>(ReduceDtype::Count);

template <typename Lanes>
constexpr void set_arithmetic(ReduceFn (&table)[kKinds][kDtypes], ReduceDtype dtype) {
  const int d = static_cast<int>(dtype);
  table[static_cast<int>(ReduceKind::Sum)][d] = reduce_parts<Lanes, Add>;
  table[static_cast<int>(ReduceKind::Product)][d] = reduce_parts<Lanes, Multiply>;
  table[static_cast<int>(ReduceKind::Min)][d] = reduce_parts<Lanes, Minimum>;
  table[static_cast<int>(ReduceKind::Max)][d] = reduce_parts<Lanes, Maximum>;
}

template <typename Lanes>
constexpr void set_floating(ReduceFn (&table)[kKinds][kDtypes], ReduceDtype dtype) {
  set_arithmetic<Lanes>(table, dtype);
  const int d = static_cast<int>(dtype);
  table[static_cast<int>(ReduceKind::Avg)][d] = reduce_parts<Lanes, Add, Extra::Average>;
  table[static_cast<int>(ReduceKind::PremulSum)][d] = reduce_parts<Lanes, Add, Extra::Scale>;
}

template <typename T>
constexpr void set_integral(ReduceFn (&table)[kKinds][kDtypes], ReduceDtype dtype) {
  set_arithmetic<Native<T>>(table, dtype);
  const int d = static_cast<int>(dtype);
  table[static_cast<int>(ReduceKind::BitAnd)][d] = reduce_parts<Native<T>, BitAnd>;
  table[static_cast<int>(ReduceKind::BitOr)][d] = reduce_parts<Native<T>, BitOr>;
  table[static_cast<int>(ReduceKind::BitXor)][d] = reduce_parts<Native<T>, BitXor>;
}

// torch stores bool as one byte holding 0 or 1: or / and / xor of those bytes are the logical operations.
constexpr void set_bool(ReduceFn (&table)[kKinds][kDtypes]) {
  const int d = static_cast<int>(ReduceDtype::Bool);
  for (ReduceKind kind : {ReduceKind::Sum, ReduceKind::Max, ReduceKind::BitOr}) {
    table[static_cast<int>(kind)][d] = reduce_parts<Native<uint8_t>, BitOr>;
  }
  for (ReduceKind kind : {ReduceKind::Product, ReduceKind::Min, ReduceKind::BitAnd}) {
    table[static_cast<int>(kind)][d] = reduce_parts<Native<uint8_t>, BitAnd>;
  }
  table[static_cast<int>(ReduceKind::BitXor)][d] = reduce_parts<Native<uint8_t>, BitXor>;
}

template <typename BFloat16Lanes>
constexpr ReduceKernels make_table(const char* isa) {
  ReduceKernels k{isa, {}};
  set_floating<Native<float>>(k.fn, ReduceDtype::Float);
  set_floating<Native<double>>(k.fn, ReduceDtype::Double);
  set_floating<Widened<c10::Half, AtenNarrow>>(k.fn, ReduceDtype::Half);
  set_floating<BFloat16Lanes>(k.fn, ReduceDtype::BFloat16);
  set_integral<int8_t>(k.fn, ReduceDtype::Int8);
  set_integral<uint8_t>(k.fn, ReduceDtype::UInt8);
  set_integral<int16_t>(k.fn, ReduceDtype::Int16);
  set_integral<int32_t>(k.fn, ReduceDtype::Int32);
  set_integral<int64_t>(k.fn, ReduceDtype::Int64);
  set_bool(k.fn);
  return k;
}

#if defined(CPU_CAPABILITY_AVX512)
// The bf16 kernels with the narrowing instruction: `flatten` inlines the loops into these entry points, which are
// compiled for the avx512bf16 target (a function without it cannot inline one that has it).
using HardwareBf16 = Widened<c10::BFloat16, HardwareBf16Narrow>;

template <typename Op, Extra kExtra = Extra::None>
ACCEL_BF16_TARGET __attribute__((flatten)) void reduce_bf16_hardware(const void* const* parts, int count, void* out,
                                                                     int64_t begin, int64_t end, double factor) {
  reduce_parts<HardwareBf16, Op, kExtra>(parts, count, out, begin, end, factor);
}

constexpr ReduceKernels make_hardware_bf16_table() {
  ReduceKernels k = make_table<Widened<c10::BFloat16, AtenNarrow>>("ACCEL_AVX512_BF16");
  const int d = static_cast<int>(ReduceDtype::BFloat16);
  k.fn[static_cast<int>(ReduceKind::Sum)][d] = reduce_bf16_hardware<Add>;
  k.fn[static_cast<int>(ReduceKind::Avg)][d] = reduce_bf16_hardware<Add, Extra::Average>;
  k.fn[static_cast<int>(ReduceKind::PremulSum)][d] = reduce_bf16_hardware<Add, Extra::Scale>;
  k.fn[static_cast<int>(ReduceKind::Product)][d] = reduce_bf16_hardware<Multiply>;
  k.fn[static_cast<int>(ReduceKind::Min)][d] = reduce_bf16_hardware<Minimum>;
  k.fn[static_cast<int>(ReduceKind::Max)][d] = reduce_bf16_hardware<Maximum>;
  return k;
}
#endif

}  // namespace
}  // namespace CPU_CAPABILITY

// constinit: built by the compiler, not at load time. A table built by this copy's code at load would run its
// instructions (AVX-512 for that copy) on every CPU, and kill the process with SIGILL where they are missing.
extern constinit const ReduceKernels ACCEL_THIS_ISA_TABLE(reduce_kernels_) =
    CPU_CAPABILITY::make_table<CPU_CAPABILITY::Widened<c10::BFloat16, CPU_CAPABILITY::AtenNarrow>>(ACCEL_THIS_ISA_NAME);

#if defined(CPU_CAPABILITY_AVX512)
extern constinit const ReduceKernels reduce_kernels_ACCEL_AVX512_BF16 = CPU_CAPABILITY::make_hardware_bf16_table();
#endif

}  // namespace accel::cpu
