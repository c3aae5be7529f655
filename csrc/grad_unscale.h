// Shared by cpu/grad_unscale.cpp and cuda/grad_unscale.cu: argument checks and the split of a gradient list
// into fixed-size chunks (the unit of parallel work on both backends).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace accel {

// The dtype code the kernels switch on (same numbering as cpu/vec/grad_kernels.h's GradDtype).
inline int grad_dtype_code(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return 0;
    case at::kHalf: return 1;
    case at::kBFloat16: return 2;
    default: return -1;
  }
}

inline void check_scalar_arg(const char* op, const char* name, const at::Tensor& t, const at::Device& device) {
  TORCH_CHECK(t.numel() == 1 && t.scalar_type() == at::kFloat, op, ": ", name,
              " must be a one-element float32 tensor, got ", t.scalar_type(), " with ", t.numel(), " elements");
  TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(), " but the gradients are on ", device);
}

// Every grad: strided, contiguous, fp32/fp16/bf16, on `device`. The Python wrapper sends anything else
// (sparse, non-contiguous, fp64) through the reference path, so reaching this is a caller bug worth naming.
inline void check_grads(const char* op, at::TensorList grads, const at::Device& device) {
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    TORCH_CHECK(g.layout() == at::kStrided, op, ": grads[", i, "] is ", g.layout(), ", only dense grads are fused");
    TORCH_CHECK(g.device() == device, op, ": grads[", i, "] is on ", g.device(), ", expected ", device);
    TORCH_CHECK(grad_dtype_code(g.scalar_type()) >= 0, op, ": grads[", i, "] is ", g.scalar_type(),
                "; the fused kernels take float32, float16 and bfloat16");
    TORCH_CHECK(g.is_contiguous(), op, ": grads[", i, "] is not contiguous");
  }
}

inline void check_unscale_args(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale,
                               const at::Tensor& sq_norms) {
  constexpr const char* op = "accel::unscale_grads_";
  const at::Device device = found_inf.device();
  check_scalar_arg(op, "found_inf", found_inf, device);
  check_scalar_arg(op, "inv_scale", inv_scale, device);
  TORCH_CHECK(sq_norms.scalar_type() == at::kDouble && sq_norms.dim() == 1 && sq_norms.is_contiguous() &&
                  sq_norms.numel() == static_cast<int64_t>(grads.size()),
              op, ": sq_norms must be a contiguous float64 vector with one entry per grad (", grads.size(),
              "), got ", sq_norms.scalar_type(), " of shape ", sq_norms.sizes());
  TORCH_CHECK(sq_norms.device() == device, op, ": sq_norms is on ", sq_norms.device(), ", expected ", device);
  check_grads(op, grads, device);
}

inline void check_clip_args(at::TensorList grads, const at::Tensor& total_norm) {
  constexpr const char* op = "accel::clip_grads_";
  if (grads.empty()) return;
  check_scalar_arg(op, "total_norm", total_norm, grads[0].device());
  check_grads(op, grads, grads[0].device());
}

// One unit of parallel work: elements [begin, end) of grads[grad].
struct GradChunk {
  int64_t grad;
  int64_t begin;
  int64_t end;
};

// Every non-empty grad cut into chunks of at most `chunk` elements, in grad order, so a grad's chunks are
// consecutive and its partial sums can be added up in a fixed order (the result does not depend on threads).
inline std::vector<GradChunk> plan_chunks(at::TensorList grads, int64_t chunk) {
  std::vector<GradChunk> chunks;
  for (size_t i = 0; i < grads.size(); ++i) {
    const int64_t n = grads[i].numel();
    for (int64_t begin = 0; begin < n; begin += chunk) {
      chunks.push_back({static_cast<int64_t>(i), begin, std::min(begin + chunk, n)});
    }
  }
  return chunks;
}

// clip_grad_norm_'s coefficient, computed as torch computes it on an fp32 total norm:
// clamp(max_norm / (total_norm + 1e-6), max=1), where `a / t` is `t.reciprocal() * a` and clamp keeps nan.
#if defined(__CUDACC__)
__host__ __device__
#endif
inline float clip_coefficient(float total_norm, float max_norm) {
  const float coef = (1.0f / (total_norm + 1e-6f)) * max_norm;
  return coef > 1.0f ? 1.0f : coef;  // nan > 1 is false: nan stays nan
}

}  // namespace accel
