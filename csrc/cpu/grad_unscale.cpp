// CPU kernels of accel::unscale_grads_ and accel::clip_grads_: one at::parallel_for over (grad, chunk) work
// items across the whole gradient list, each item run by the vectorized kernels of cpu/vec/ for the instruction
// set torch itself uses.
#include "../grad_unscale.h"
#include "vec/grad_kernels.h"

#include <ATen/Version.h>  // at::get_cpu_capability
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <string>

namespace accel {
namespace {

using cpu::ChunkStats;
using cpu::GradKernels;

// 32 Ki elements: 128 KiB of fp32, a chunk stays in L2 while it is read and written.
constexpr int64_t kChunkElements = 32 << 10;
// Below ~256 Ki elements in all, handing work to the thread pool costs more than the pass itself.
constexpr int64_t kMinElementsPerTask = 256 << 10;

// The kernel table for the CPU capability torch runs with (ATEN_CPU_CAPABILITY lowers it, as for torch's own
// kernels), limited to what this build compiled.
const GradKernels& kernels() {
  static const GradKernels* chosen = [] {
    const std::string isa = at::get_cpu_capability();
#if defined(ACCEL_CPU_AVX512)
    if (isa == "AVX512") return &cpu::grad_kernels_ACCEL_AVX512;
#endif
#if defined(ACCEL_CPU_AVX2)
    if (isa == "AVX512" || isa == "AVX2") return &cpu::grad_kernels_ACCEL_AVX2;
#endif
    return &cpu::grad_kernels_ACCEL_DEFAULT;
  }();
  return *chosen;
}

int64_t total_elements(const std::vector<GradChunk>& chunks) {
  int64_t total = 0;
  for (const GradChunk& c : chunks) total += c.end - c.begin;
  return total;
}

// Runs fn(chunk_index) for every chunk; items per task chosen so that each task has enough elements.
template <typename Fn>
void for_each_chunk(const std::vector<GradChunk>& chunks, const Fn& fn) {
  if (chunks.empty()) return;
  const int64_t n = static_cast<int64_t>(chunks.size());
  const int64_t average = std::max<int64_t>(1, total_elements(chunks) / n);
  const int64_t grain = std::max<int64_t>(1, kMinElementsPerTask / average);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) fn(i);
  });
}

void* chunk_data(const at::Tensor& grad, const GradChunk& c) {
  return static_cast<char*>(grad.data_ptr()) + c.begin * grad.element_size();
}

void unscale_grads_cpu(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale,
                       const at::Tensor& sq_norms) {
  check_unscale_args(grads, found_inf, inv_scale, sq_norms);
  const float inv = inv_scale.data_ptr<float>()[0];
  const std::vector<GradChunk> chunks = plan_chunks(grads, kChunkElements);
  const GradKernels& k = kernels();
  // Each chunk's result is written once, by the thread that ran it; the sums below add them in chunk order.
  std::vector<ChunkStats> stats(chunks.size());
  for_each_chunk(chunks, [&](int64_t i) {
    const GradChunk& c = chunks[i];
    const at::Tensor& g = grads[c.grad];
    stats[i] = k.unscale[grad_dtype_code(g.scalar_type())](chunk_data(g, c), c.end - c.begin, inv);
  });
  double* sums = sq_norms.data_ptr<double>();
  std::fill(sums, sums + grads.size(), 0.0);
  bool non_finite = false;
  for (size_t i = 0; i < chunks.size(); ++i) {
    sums[chunks[i].grad] += stats[i].sum_sq;
    non_finite |= stats[i].non_finite;
  }
  if (non_finite) found_inf.data_ptr<float>()[0] = 1.0f;  // set, never cleared: as torch's unscale does
}

void clip_grads_cpu(at::TensorList grads, const at::Tensor& total_norm, double max_norm) {
  check_clip_args(grads, total_norm);
  if (grads.empty()) return;
  const float coef = clip_coefficient(total_norm.data_ptr<float>()[0], static_cast<float>(max_norm));
  if (coef == 1.0f) return;  // torch multiplies by 1.0, which changes no value
  const std::vector<GradChunk> chunks = plan_chunks(grads, kChunkElements);
  const GradKernels& k = kernels();
  for_each_chunk(chunks, [&](int64_t i) {
    const GradChunk& c = chunks[i];
    const at::Tensor& g = grads[c.grad];
    k.scale[grad_dtype_code(g.scalar_type())](chunk_data(g, c), c.end - c.begin, coef);
  });
}

}  // namespace
}  // namespace accel

TORCH_LIBRARY_IMPL(accel, CPU, m) {
  m.impl("unscale_grads_", &accel::unscale_grads_cpu);
  m.impl("clip_grads_", &accel::clip_grads_cpu);
}
