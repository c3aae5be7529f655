// How the per-instruction-set copies of this folder's kernels are named and picked.
//
// Each cpu/vec/*.cpp is built once per instruction set (setup.py: DEFAULT, AVX2, AVX512) with
// -DCPU_CAPABILITY=ACCEL_<isa>, and exports one table of kernels named <prefix>ACCEL_<isa> (ACCEL_THIS_ISA_TABLE
// names it in the copy being compiled); the AVX512 copy also exports <prefix>ACCEL_AVX512_BF16, whose kernels narrow
// bf16 with AVX512-BF16's instruction. The op's own file picks the copy torch itself runs with:
// pick_for_this_cpu<Table>(ACCEL_ISA_TABLES(cpu::<prefix>)).
#pragma once

#include <ATen/Version.h>  // at::get_cpu_capability

#include <string>

#define ACCEL_PASTE_(a, b) a##b
#define ACCEL_PASTE(a, b) ACCEL_PASTE_(a, b)
#define ACCEL_STRINGIFY_(x) #x
#define ACCEL_STRINGIFY(x) ACCEL_STRINGIFY_(x)
// In a copy compiled with CPU_CAPABILITY=ACCEL_<isa>: its table's name, <prefix>ACCEL_<isa>, and "ACCEL_<isa>".
#define ACCEL_THIS_ISA_TABLE(prefix) ACCEL_PASTE(prefix, CPU_CAPABILITY)
#define ACCEL_THIS_ISA_NAME ACCEL_STRINGIFY(CPU_CAPABILITY)

#if defined(ACCEL_CPU_AVX512)
#define ACCEL_IF_AVX512_(table) &table
#else
#define ACCEL_IF_AVX512_(table) nullptr
#endif
#if defined(ACCEL_CPU_AVX2)
#define ACCEL_IF_AVX2_(table) &table
#else
#define ACCEL_IF_AVX2_(table) nullptr
#endif
// Every copy of the tables named <prefix><isa> as an IsaTables initializer, nullptr for the copies this build lacks.
#define ACCEL_ISA_TABLES(prefix)                                                             \
  {ACCEL_IF_AVX512_(prefix##ACCEL_AVX512_BF16), ACCEL_IF_AVX512_(prefix##ACCEL_AVX512), \
   ACCEL_IF_AVX2_(prefix##ACCEL_AVX2), &prefix##ACCEL_DEFAULT}

namespace accel::cpu {

#if defined(ACCEL_CPU_AVX512)
// Whether this CPU has AVX512-BF16 (the *_ACCEL_AVX512_BF16 tables run only where it does).
bool avx512_bf16_supported();
#endif

template <typename Table>
struct IsaTables {
  const Table* avx512_bf16;  // nullptr where this build has no AVX512 copy
  const Table* avx512;
  const Table* avx2;  // nullptr where this build has no AVX2 copy
  const Table* fallback;
};

// The table for the CPU capability torch runs with (ATEN_CPU_CAPABILITY lowers it, as for torch's own kernels),
// limited to what this build compiled.
template <typename Table>
const Table& pick_for_this_cpu(const IsaTables<Table>& tables) {
  [[maybe_unused]] const std::string isa = at::get_cpu_capability();
#if defined(ACCEL_CPU_AVX512)
  if (isa == "AVX512") return avx512_bf16_supported() ? *tables.avx512_bf16 : *tables.avx512;
#endif
#if defined(ACCEL_CPU_AVX2)
  if (isa == "AVX512" || isa == "AVX2") return *tables.avx2;
#endif
  return *tables.fallback;
}

}  // namespace accel::cpu
