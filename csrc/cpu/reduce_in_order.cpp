// accel::reduce_in_order_ and the C++ entry point the shared-memory process group uses: picks the kernel table
// of cpu/vec/reduce_kernels.cpp for the instruction set torch runs with, and splits large reductions over torch's
// intra-op threads (each element is combined by one thread, in the fixed order, so the split changes no bit).
#include "../dense_values.h"
#include "../reduce_in_order.h"

#include "vec/isa_tables.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <array>
#include <vector>

namespace accel {
namespace {

using cpu::ReduceDtype;
using cpu::ReduceKernels;

constexpr std::array<const char*, static_cast<size_t>(ReduceKind::Count)> kKindNames = {
    "sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum"};

// Below ~256 KiB of input in all, waking other threads costs more than the pass itself.
constexpr int64_t kMinParallelBytes = 256 << 10;
constexpr int64_t kGrainBytes = 64 << 10;

const ReduceKernels& kernels() {
  static const ReduceKernels& chosen = cpu::pick_for_this_cpu<ReduceKernels>(ACCEL_ISA_TABLES(cpu::reduce_kernels_));
  return chosen;
}

int dtype_code(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return static_cast<int>(ReduceDtype::Float);
    case at::kDouble: return static_cast<int>(ReduceDtype::Double);
    case at::kHalf: return static_cast<int>(ReduceDtype::Half);
    case at::kBFloat16: return static_cast<int>(ReduceDtype::BFloat16);
    case at::kChar: return static_cast<int>(ReduceDtype::Int8);
    case at::kByte: return static_cast<int>(ReduceDtype::UInt8);
    case at::kShort: return static_cast<int>(ReduceDtype::Int16);
    case at::kInt: return static_cast<int>(ReduceDtype::Int32);
    case at::kLong: return static_cast<int>(ReduceDtype::Int64);
    case at::kBool: return static_cast<int>(ReduceDtype::Bool);
    default: return -1;
  }
}

cpu::ReduceFn kernel_for(at::ScalarType dtype, ReduceKind kind) {
  const int code = dtype_code(dtype);
  return code < 0 ? nullptr : kernels().fn[static_cast<int>(kind)][code];
}

// --- the op ------------------------------------------------------------------------------------------------------

void check_parts(at::TensorList parts, const at::Tensor& out) {
  TORCH_CHECK(!parts.empty(), "accel::reduce_in_order_: needs at least one part");
  TORCH_CHECK(parts.size() <= 1024, "accel::reduce_in_order_: at most 1024 parts, got ", parts.size());
  TORCH_CHECK(out.device().is_cpu(), "accel::reduce_in_order_: out is on ", out.device(), ", expected the CPU");
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor& part = parts[i];
    TORCH_CHECK(part.device().is_cpu(), "accel::reduce_in_order_: parts[", i, "] is on ", part.device());
    TORCH_CHECK(part.scalar_type() == out.scalar_type(), "accel::reduce_in_order_: parts[", i, "] is ",
                part.scalar_type(), " but out is ", out.scalar_type());
    TORCH_CHECK(part.numel() == out.numel(), "accel::reduce_in_order_: parts[", i, "] has ", part.numel(),
                " elements but out has ", out.numel());
  }
}

void reduce_in_order_cpu(at::TensorList parts, c10::string_view op, const at::Tensor& out, double factor) {
  check_parts(parts, out);
  const ReduceKind kind = reduce_kind_from_name(std::string(op));
  TORCH_CHECK(reduce_in_order_supported(out.scalar_type(), kind), "accel::reduce_in_order_: no '", op,
              "' reduction of ", out.scalar_type(), " tensors");
  std::vector<at::Tensor> dense;  // keeps contiguous copies alive
  std::vector<const void*> pointers;
  for (const at::Tensor& part : parts) {
    dense.push_back(dense_values(part));
    pointers.push_back(dense.back().const_data_ptr());
  }
  const at::Tensor target = out.is_contiguous() ? out : at::empty_like(out, at::MemoryFormat::Contiguous);
  reduce_in_order(pointers.data(), static_cast<int>(pointers.size()), target.mutable_data_ptr(), out.numel(),
                  out.scalar_type(), kind, factor);
  if (!target.is_same(out)) out.copy_(target);
}

}  // namespace

ReduceKind reduce_kind_from_name(const std::string& name) {
  for (size_t i = 0; i < kKindNames.size(); ++i) {
    if (name == kKindNames[i]) return static_cast<ReduceKind>(i);
  }
  TORCH_CHECK(false, "unknown reduction '", name, "'; expected one of sum, avg, product, min, max, band, bor, bxor, "
              "premul_sum");
}

const char* reduce_kind_name(ReduceKind kind) { return kKindNames.at(static_cast<size_t>(kind)); }

bool reduce_in_order_supported(at::ScalarType dtype, ReduceKind kind) { return kernel_for(dtype, kind) != nullptr; }

void reduce_in_order(const void* const* parts, int count, void* out, int64_t n, at::ScalarType dtype, ReduceKind kind,
                     double factor) {
  const cpu::ReduceFn fn = kernel_for(dtype, kind);
  TORCH_INTERNAL_ASSERT(fn != nullptr, "no ", reduce_kind_name(kind), " kernel for ", dtype);
  const int64_t element = static_cast<int64_t>(c10::elementSize(dtype));
  if (n * element * count < kMinParallelBytes || at::get_num_threads() < 2 || at::in_parallel_region()) {
    fn(parts, count, out, 0, n, factor);
    return;
  }
  at::parallel_for(0, n, std::max<int64_t>(1, kGrainBytes / element), [&](int64_t begin, int64_t end) {
    fn(parts, count, out, begin, end, factor);
  });
}

}  // namespace accel

TORCH_LIBRARY_IMPL(accel, CPU, m) {
  m.impl("reduce_in_order_", &accel::reduce_in_order_cpu);
}
