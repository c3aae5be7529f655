// CUDA kernels of accel::unscale_grads_ and accel::clip_grads_: multi-tensor apply over the whole gradient list.
//
// The host cuts every grad into chunks (plan_chunks, as on the CPU) and uploads one 16-byte record per chunk
// through pinned memory, asynchronously; each CUDA block then handles one chunk of whichever grad it belongs to.
// So one launch covers thousands of small tensors, with no per-tensor launch and no kernel-argument size limit.
// Sums of squares: fp32 per thread, then fp64 across the block (one partial per block), then fp64 per grad by
// a second kernel that adds each grad's partials in chunk order, so results do not depend on scheduling. Nothing
// here waits for the device: inv_scale, found_inf and total_norm are read and written where they live.
#include "../grad_unscale.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace accel {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kChunkElements = 64 << 10;  // per block: 128 elements per thread

struct BlockWork {  // one chunk of one grad; 16 bytes
  void* data;       // the chunk's first element
  int32_t count;    // elements in the chunk
  int32_t dtype;    // grad_dtype_code
};

struct GradSpan {  // the consecutive blocks of one grad
  int32_t first_block;
  int32_t num_blocks;
};

// The work list on the device. The pinned staging buffer comes from torch's caching host allocator, which keeps
// it alive until the asynchronous copy has run; the device copy is stream-ordered like any tensor.
struct DeviceWork {
  at::Tensor storage;
  const BlockWork* blocks = nullptr;
  const GradSpan* spans = nullptr;
  int64_t num_blocks = 0;
};

DeviceWork upload_work(at::TensorList grads, const at::Device& device) {
  const std::vector<GradChunk> chunks = plan_chunks(grads, kChunkElements);
  std::vector<BlockWork> blocks;
  blocks.reserve(chunks.size());
  std::vector<GradSpan> spans(grads.size(), GradSpan{0, 0});
  for (const GradChunk& c : chunks) {
    const at::Tensor& g = grads[c.grad];
    GradSpan& span = spans[c.grad];
    if (span.num_blocks == 0) span.first_block = static_cast<int32_t>(blocks.size());
    ++span.num_blocks;
    blocks.push_back({static_cast<char*>(g.data_ptr()) + c.begin * g.element_size(),
                      static_cast<int32_t>(c.end - c.begin), grad_dtype_code(g.scalar_type())});
  }
  const size_t block_bytes = blocks.size() * sizeof(BlockWork);
  const size_t total = block_bytes + spans.size() * sizeof(GradSpan);
  DeviceWork work;
  work.num_blocks = static_cast<int64_t>(blocks.size());
  if (total == 0) return work;
  at::Tensor staging = at::empty({static_cast<int64_t>(total)}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  auto* bytes = static_cast<char*>(staging.data_ptr());
  std::memcpy(bytes, blocks.data(), block_bytes);
  std::memcpy(bytes + block_bytes, spans.data(), spans.size() * sizeof(GradSpan));
  work.storage = at::empty({static_cast<int64_t>(total)}, at::TensorOptions().dtype(at::kByte).device(device));
  work.storage.copy_(staging, /*non_blocking=*/true);
  const auto* base = static_cast<const char*>(work.storage.const_data_ptr());
  work.blocks = reinterpret_cast<const BlockWork*>(base);
  work.spans = reinterpret_cast<const GradSpan*>(base + block_bytes);
  return work;
}

// Unscales one chunk; adds this thread's sum of squares of the unscaled fp32 values (before narrowing, as on the
// CPU) and whether it read inf/nan.
template <typename T>
__device__ void unscale_elements(const BlockWork& w, float inv_scale, float& sum_sq, bool& non_finite) {
  T* p = static_cast<T*>(w.data);
  const bool read_only = inv_scale == 1.0f;  // torch returns the value itself then
  for (int i = threadIdx.x; i < w.count; i += blockDim.x) {
    float v = static_cast<float>(p[i]);
    non_finite |= !isfinite(v);  // checked before unscaling, as torch does
    if (!read_only) {
      v *= inv_scale;
      p[i] = static_cast<T>(v);
    }
    sum_sq += v * v;
  }
}

__device__ double block_sum(double value) {
  __shared__ double warp_sums[kWarps];
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  value = 0.0;
  if (warp == 0) {
    value = lane < kWarps ? warp_sums[lane] : 0.0;
    for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  }
  return value;  // valid in thread 0
}

__global__ void __launch_bounds__(kThreads)
unscale_kernel(const BlockWork* __restrict__ blocks, const float* __restrict__ inv_scale, float* found_inf,
               double* __restrict__ partials) {
  const BlockWork w = blocks[blockIdx.x];
  const float inv = *inv_scale;
  float sum_sq = 0.0f;
  bool non_finite = false;
  switch (w.dtype) {
    case 0: unscale_elements<float>(w, inv, sum_sq, non_finite); break;
    case 1: unscale_elements<c10::Half>(w, inv, sum_sq, non_finite); break;
    default: unscale_elements<c10::BFloat16>(w, inv, sum_sq, non_finite); break;
  }
  const bool any_non_finite = __syncthreads_or(non_finite);
  const double total = block_sum(static_cast<double>(sum_sq));
  if (threadIdx.x == 0) {
    partials[blockIdx.x] = total;
    if (any_non_finite) *found_inf = 1.0f;  // every writer writes 1: the race is benign
  }
}

// sq_norms[g] = the partials of grad g's blocks, added in chunk order.
__global__ void sum_partials_kernel(const GradSpan* __restrict__ spans, const double* __restrict__ partials,
                                    double* __restrict__ sq_norms, int64_t num_grads) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= num_grads) return;
  const GradSpan span = spans[g];
  double total = 0.0;
  for (int32_t b = 0; b < span.num_blocks; ++b) total += partials[span.first_block + b];
  sq_norms[g] = total;
}

// torch's clip multiplies fp16/bf16 grads by the coefficient rounded to their dtype first: for a float coefficient
// tensor CUDA's _foreach_mul_ takes its per-tensor path, whose kernel loads that scalar as T (the CPU kernel reads
// it as float, and so does accel's CPU kernel). Rounding here keeps the result bit-identical on each device.
template <typename T>
__device__ void scale_elements(const BlockWork& w, float coef) {
  const float factor = static_cast<float>(static_cast<T>(coef));
  T* p = static_cast<T*>(w.data);
  for (int i = threadIdx.x; i < w.count; i += blockDim.x) p[i] = static_cast<T>(static_cast<float>(p[i]) * factor);
}

__global__ void __launch_bounds__(kThreads)
clip_kernel(const BlockWork* __restrict__ blocks, const float* __restrict__ total_norm, float max_norm) {
  const float coef = clip_coefficient(*total_norm, max_norm);
  if (coef == 1.0f) return;  // torch multiplies by 1.0, which changes no value
  const BlockWork w = blocks[blockIdx.x];
  switch (w.dtype) {
    case 0: scale_elements<float>(w, coef); break;
    case 1: scale_elements<c10::Half>(w, coef); break;
    default: scale_elements<c10::BFloat16>(w, coef); break;
  }
}

void unscale_grads_cuda(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale,
                        const at::Tensor& sq_norms) {
  check_unscale_args(grads, found_inf, inv_scale, sq_norms);
  if (grads.empty()) return;
  const c10::cuda::CUDAGuard guard(found_inf.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const DeviceWork work = upload_work(grads, found_inf.device());
  at::Tensor partials = at::empty({std::max<int64_t>(work.num_blocks, 1)}, sq_norms.options());
  if (work.num_blocks > 0) {
    unscale_kernel<<<static_cast<unsigned>(work.num_blocks), kThreads, 0, stream>>>(
        work.blocks, inv_scale.const_data_ptr<float>(), found_inf.mutable_data_ptr<float>(),
        partials.mutable_data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const int64_t num_grads = static_cast<int64_t>(grads.size());
  constexpr int threads = 256;
  sum_partials_kernel<<<static_cast<unsigned>((num_grads + threads - 1) / threads), threads, 0, stream>>>(
      work.spans, partials.const_data_ptr<double>(), sq_norms.mutable_data_ptr<double>(), num_grads);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void clip_grads_cuda(at::TensorList grads, const at::Tensor& total_norm, double max_norm) {
  check_clip_args(grads, total_norm);
  if (grads.empty()) return;
  const c10::cuda::CUDAGuard guard(total_norm.device());
  const DeviceWork work = upload_work(grads, total_norm.device());
  if (work.num_blocks == 0) return;
  clip_kernel<<<static_cast<unsigned>(work.num_blocks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      work.blocks, total_norm.const_data_ptr<float>(), static_cast<float>(max_norm));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace accel

TORCH_LIBRARY_IMPL(accel, CUDA, m) {
  m.impl("unscale_grads_", &accel::unscale_grads_cuda);
  m.impl("clip_grads_", &accel::clip_grads_cuda);
}
