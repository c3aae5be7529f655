// CUDA kernel of accel::pad_into: one grid-stride pass over out, each element either copied or padded.
#include "../pad_into.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

namespace accel {
namespace {

template <typename T>
__global__ void pad_kernel(const T* __restrict__ src, T* __restrict__ out, PadGeometry g, T pad, int64_t total) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total; e += stride) {
    const int64_t row = e / g.out_row, col = e % g.out_row - g.offset;
    out[e] = (col >= 0 && col < g.src_row) ? src[row * g.src_row + col] : pad;
  }
}

template <typename T>
void launch_pad(const at::Tensor& src, const at::Tensor& out, const PadGeometry& g, const PadPattern& pattern) {
  const int64_t total = g.rows * g.out_row;
  if (total == 0) return;
  T pad;
  std::memcpy(&pad, pattern.bytes, sizeof(T));
  constexpr int threads = 256;
  const int64_t wanted = (total + threads - 1) / threads;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int blocks = static_cast<int>(std::min<int64_t>(wanted, static_cast<int64_t>(sms) * 32));
  pad_kernel<T><<<blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
      static_cast<const T*>(src.const_data_ptr()), static_cast<T*>(out.mutable_data_ptr()), g, pad, total);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void pad_into_cuda(const at::Tensor& src, int64_t dim, const c10::Scalar& pad_value, bool pad_first,
                   const at::Tensor& out) {
  dim = checked_pad_dim(src, dim, out);
  const c10::cuda::CUDAGuard guard(out.device());
  const at::Tensor src_c = src.contiguous();
  const PadGeometry g = pad_geometry(src_c, dim, pad_first, out);
  const PadPattern pattern = pad_pattern(pad_value, src.scalar_type());
  switch (g.elem_size) {
    case 1: launch_pad<uint8_t>(src_c, out, g, pattern); break;
    case 2: launch_pad<uint16_t>(src_c, out, g, pattern); break;
    case 4: launch_pad<uint32_t>(src_c, out, g, pattern); break;
    case 8: launch_pad<uint64_t>(src_c, out, g, pattern); break;
    case 16: launch_pad<Bytes16>(src_c, out, g, pattern); break;
    default: TORCH_INTERNAL_ASSERT(false, "accel::pad_into: unexpected element size ", g.elem_size);
  }
}

}  // namespace
}  // namespace accel

TORCH_LIBRARY_IMPL(accel, CUDA, m) { m.impl("pad_into", &accel::pad_into_cuda); }
