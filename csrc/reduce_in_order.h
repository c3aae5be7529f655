// Fixed-order elementwise reduction of several equally long CPU arrays (cpu/reduce_in_order.cpp): the arithmetic
// of accel's shared-memory process group, also exposed as the op accel::reduce_in_order_.
#pragma once

#include "cpu/vec/reduce_kernels.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace accel {

using cpu::ReduceKind;

// Whether reduce_in_order has a kernel for `dtype` and `kind` (avg and premul_sum need a floating-point dtype, the
// bitwise ops an integral or bool one; fp32, fp64, fp16, bf16, int8/16/32/64, uint8 and bool have kernels).
bool reduce_in_order_supported(at::ScalarType dtype, ReduceKind kind);

// out[i] = parts[0][i] op parts[1][i] op ... op parts[count - 1][i] for i < n, always in that order (see
// cpu/vec/reduce_kernels.h): the same bits for the same parts, whichever instruction set, thread count or split.
// Large reductions run on torch's intra-op threads. The caller checks reduce_in_order_supported first.
void reduce_in_order(const void* const* parts, int count, void* out, int64_t n, at::ScalarType dtype, ReduceKind kind,
                     double factor);

// "sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum" (torch.distributed.ReduceOp's names).
ReduceKind reduce_kind_from_name(const std::string& name);
const char* reduce_kind_name(ReduceKind kind);

}  // namespace accel
