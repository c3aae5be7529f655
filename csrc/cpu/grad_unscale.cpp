// CPU kernels of accel::unscale_grads_ and accel::clip_grads_: the whole gradient list cut into (grad, chunk)
// work items, grouped into tasks that torch's intra-op threads claim from a shared counter; each item is run by
// the vectorized kernels of cpu/vec/ for the instruction set torch itself uses.
#include "../grad_unscale.h"
#include "vec/grad_kernels.h"
#include "vec/isa_tables.h"

#include <ATen/Parallel.h>
#include <c10/util/irange.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <string>

namespace accel {
namespace {

using cpu::ChunkStats;
using cpu::GradKernels;

// 32 Ki elements: 128 KiB of fp32, a chunk stays in L2 while it is read and written.
constexpr int64_t kChunkElements = 32 << 10;
// A task: consecutive chunks of at least 64 Ki elements in all (tens of microseconds of work), so claiming one
// costs little next to running it, and threads finish within a task's time of each other.
constexpr int64_t kTaskElements = 64 << 10;
// Below ~256 Ki elements in all, waking another thread costs more than the pass itself.
constexpr int64_t kMinParallelElements = 256 << 10;

const GradKernels& kernels() {
  static const GradKernels& chosen = cpu::pick_for_this_cpu<GradKernels>(ACCEL_ISA_TABLES(cpu::grad_kernels_));
  return chosen;
}

// The first chunk of each task, and chunks.size() at the end.
std::vector<int64_t> plan_tasks(const std::vector<GradChunk>& chunks) {
  std::vector<int64_t> starts{0};
  int64_t elements = 0;
  for (const int64_t i : c10::irange(static_cast<int64_t>(chunks.size()))) {
    elements += chunks[i].end - chunks[i].begin;
    if (elements >= kTaskElements) {
      starts.push_back(i + 1);
      elements = 0;
    }
  }
  if (starts.back() != static_cast<int64_t>(chunks.size())) starts.push_back(static_cast<int64_t>(chunks.size()));
  return starts;
}

// Runs fn(task) for every task in [0, num_tasks) on torch's intra-op threads, which claim tasks from a shared
// counter rather than each taking a fixed share (at::parallel_for's split): a thread that starts late (its core
// busy with another process or a data-loader worker) finds the others done with the work, instead of making them
// wait at the end of the parallel region for it to run its share.
void run_tasks(int64_t num_tasks, int64_t elements, const std::function<void(int64_t)>& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_tasks);
  if (threads < 2 || elements < kMinParallelElements) {
    for (const int64_t i : c10::irange(num_tasks)) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < num_tasks;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(i);
    }
  });
}

// One chunk as the kernels see it. Resolved on the calling thread, so the other threads touch no at::Tensor
// (data_ptr() may materialize a copy-on-write storage, which two threads must not do at once).
struct ChunkWork {
  void* data;
  int64_t count;
  int dtype;  // grad_dtype_code
};

struct Plan {
  std::vector<GradChunk> chunks;
  std::vector<ChunkWork> work;   // one per chunk
  std::vector<int64_t> starts;   // plan_tasks(chunks)
  int64_t elements = 0;
};

Plan plan(at::TensorList grads) {
  Plan p;
  p.chunks = plan_chunks(grads, kChunkElements);
  p.work.reserve(p.chunks.size());
  for (const GradChunk& c : p.chunks) {
    const at::Tensor& g = grads[c.grad];
    p.work.push_back({static_cast<char*>(g.data_ptr()) + c.begin * g.element_size(), c.end - c.begin,
                      grad_dtype_code(g.scalar_type())});
    p.elements += c.end - c.begin;
  }
  p.starts = plan_tasks(p.chunks);
  return p;
}

// Runs fn(chunk index, its work) for every chunk, task by task.
template <typename Fn>
void for_each_chunk(const Plan& p, const Fn& fn) {
  if (p.chunks.empty()) return;
  run_tasks(static_cast<int64_t>(p.starts.size()) - 1, p.elements, [&](int64_t task) {
    for (int64_t i = p.starts[task]; i < p.starts[task + 1]; ++i) fn(i, p.work[i]);
  });
}

void unscale_grads_cpu(at::TensorList grads, const at::Tensor& found_inf, const at::Tensor& inv_scale,
                       const at::Tensor& sq_norms) {
  check_unscale_args(grads, found_inf, inv_scale, sq_norms);
  const float inv = inv_scale.data_ptr<float>()[0];
  const Plan p = plan(grads);
  const GradKernels& k = kernels();
  // Each chunk's result is written once, by the thread that ran it; the sums below add them in chunk order.
  std::vector<ChunkStats> stats(p.chunks.size());
  for_each_chunk(p, [&](int64_t i, const ChunkWork& w) { stats[i] = k.unscale[w.dtype](w.data, w.count, inv); });
  double* sums = sq_norms.data_ptr<double>();
  std::fill(sums, sums + grads.size(), 0.0);
  bool non_finite = false;
  for (size_t i = 0; i < p.chunks.size(); ++i) {
    sums[p.chunks[i].grad] += stats[i].sum_sq;
    non_finite |= stats[i].non_finite;
  }
  if (non_finite) found_inf.data_ptr<float>()[0] = 1.0f;  // set, never cleared: as torch's unscale does
}

void clip_grads_cpu(at::TensorList grads, const at::Tensor& total_norm, double max_norm) {
  check_clip_args(grads, total_norm);
  if (grads.empty()) return;
  const float coef = clip_coefficient(total_norm.data_ptr<float>()[0], static_cast<float>(max_norm));
  if (coef == 1.0f) return;  // torch multiplies by 1.0, which changes no value
  const Plan p = plan(grads);
  const GradKernels& k = kernels();
  for_each_chunk(p, [&](int64_t, const ChunkWork& w) { k.scale[w.dtype](w.data, w.count, coef); });
}

}  // namespace
}  // namespace accel

TORCH_LIBRARY_IMPL(accel, CPU, m) {
  m.impl("unscale_grads_", &accel::unscale_grads_cpu);
  m.impl("clip_grads_", &accel::clip_grads_cpu);
}
