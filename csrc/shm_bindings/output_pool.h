// The outputs of accel's shared-memory gathers: fresh tensors whose freed buffers are kept for the next output of
// the same size class (ACCEL_SHM_KEEP_BYTES), faulted in at once (output_pool.cpp says why).
#pragma once

#include <ATen/ATen.h>

namespace accel::transport {

// An empty tensor for a gather's output: from the pool from 64 KiB, else from the CPU allocator.
at::Tensor fresh_output(at::IntArrayRef shape, const at::TensorOptions& options);

}  // namespace accel::transport
