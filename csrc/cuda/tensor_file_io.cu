// CUDA kernels of accel::write_tensors_ and accel::read_tensors_: the same files as the CPU kernels, for lists
// that hold CUDA tensors (the dispatcher sends any list with one here; CPU tensors in it take the CPU path).
//
// GPU bytes go through two pinned host buffers of one chunk each, used in turn: while the disk takes chunk i from
// one buffer, a side stream copies chunk i+1 into the other (write), or the other way round (read). Peak extra
// memory is those two buffers, whatever the checkpoint's size. The side stream first waits for the current
// stream (the tensors are ready there); after a read the current stream waits for the side stream.
#include "../tensor_file_io.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <array>

namespace accel {
namespace {

using namespace tensor_file_io;

// The CPU tensors of a list, and the chunks of its CUDA ones (memory = device pointer).
struct SplitIo {
  std::vector<at::Tensor> host_tensors;
  std::vector<int64_t> host_offsets;
  std::vector<IoChunk> device_chunks;
  c10::optional<at::Device> device;
};

SplitIo split_by_device(at::TensorList tensors, at::IntArrayRef offsets, int64_t base, const char* op) {
  TORCH_CHECK(offsets.size() == tensors.size(), op, ": ", tensors.size(), " tensors but ", offsets.size(), " offsets");
  SplitIo split;
  std::vector<at::Tensor> device_tensors;
  std::vector<int64_t> device_offsets;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.device().is_cpu()) {
      split.host_tensors.push_back(t);
      split.host_offsets.push_back(offsets[i]);
      continue;
    }
    TORCH_CHECK(t.device().is_cuda(), op, ": tensors[", i, "] is on ", t.device(), ", expected CPU or CUDA");
    TORCH_CHECK(!split.device || *split.device == t.device(), op, ": tensors on two GPUs (", *split.device, " and ",
                t.device(), ")");
    split.device = t.device();
    device_tensors.push_back(t);
    device_offsets.push_back(offsets[i]);
  }
  split.device_chunks = plan_io(device_tensors, device_offsets, base, op);
  return split;
}

// Two pinned chunk buffers, the side stream and an event per buffer.
class PinnedPipeline {
 public:
  explicit PinnedPipeline(const at::Device& device)
      : stream_(at::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())) {
    for (auto& buffer : buffers_) {
      buffer = at::empty({kChunkBytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
    }
    at::cuda::CUDAEvent ready;
    ready.record(at::cuda::getCurrentCUDAStream(device.index()));
    ready.block(stream_);  // the tensors were produced on the current stream
  }

  char* buffer(size_t i) { return static_cast<char*>(buffers_[i % 2].data_ptr()); }
  cudaStream_t stream() const { return stream_.stream(); }
  void record(size_t i) { events_[i % 2].record(stream_); }
  void wait(size_t i) { events_[i % 2].synchronize(); }
  // Later work on the current stream sees what this pipeline copied to the device.
  void hand_back(const at::Device& device) {
    at::cuda::CUDAEvent done;
    done.record(stream_);
    done.block(at::cuda::getCurrentCUDAStream(device.index()));
  }

 private:
  at::cuda::CUDAStream stream_;
  std::array<at::Tensor, 2> buffers_;
  std::array<at::cuda::CUDAEvent, 2> events_;
};

SysError write_device_chunks(const SplitIo& split, const File& file) {
  if (split.device_chunks.empty()) return {};
  const c10::cuda::CUDAGuard guard(*split.device);
  PinnedPipeline pipeline(*split.device);
  const auto& chunks = split.device_chunks;
  auto pwrite_fn = [&](char* memory, size_t bytes, int64_t offset) { return ::pwrite(file.fd(), memory, bytes, offset); };
  FirstError error;
  auto copy_out = [&](size_t i) {  // device -> pinned buffer i % 2, asynchronously
    C10_CUDA_CHECK(cudaMemcpyAsync(pipeline.buffer(i), chunks[i].memory, chunks[i].bytes, cudaMemcpyDeviceToHost,
                                   pipeline.stream()));
    pipeline.record(i);
  };
  copy_out(0);
  for (size_t i = 0; i < chunks.size() && !error.failed(); ++i) {
    pipeline.wait(i);
    if (i + 1 < chunks.size()) copy_out(i + 1);  // the other buffer: its previous chunk was written in step i - 1
    IoChunk staged = chunks[i];
    staged.memory = pipeline.buffer(i);
    transfer_chunk(staged, pwrite_fn, file, "write", error);
    start_writeback(file, staged);
  }
  C10_CUDA_CHECK(cudaStreamSynchronize(pipeline.stream()));  // no copy may still target a buffer we release
  return error.raise_or_return();
}

SysError read_device_chunks(const SplitIo& split, const File& file) {
  if (split.device_chunks.empty()) return {};
  const c10::cuda::CUDAGuard guard(*split.device);
  PinnedPipeline pipeline(*split.device);
  const auto& chunks = split.device_chunks;
  auto pread_fn = [&](char* memory, size_t bytes, int64_t offset) { return ::pread(file.fd(), memory, bytes, offset); };
  FirstError error;
  for (size_t i = 0; i < chunks.size() && !error.failed(); ++i) {
    if (i >= 2) pipeline.wait(i);  // the copy that last read this buffer (chunk i - 2) is done
    IoChunk staged = chunks[i];
    staged.memory = pipeline.buffer(i);
    transfer_chunk(staged, pread_fn, file, "read", error);
    if (error.failed()) break;
    C10_CUDA_CHECK(cudaMemcpyAsync(chunks[i].memory, pipeline.buffer(i), chunks[i].bytes, cudaMemcpyHostToDevice,
                                   pipeline.stream()));
    pipeline.record(i);
  }
  C10_CUDA_CHECK(cudaStreamSynchronize(pipeline.stream()));
  const SysError failed = error.raise_or_return();
  pipeline.hand_back(*split.device);
  return failed;
}

void write_tensors_cuda(int64_t fd, c10::string_view path, const at::Tensor& header, at::TensorList tensors,
                        at::IntArrayRef offsets, const at::Tensor& status_out) {
  constexpr const char* op = "accel::write_tensors_";
  Status status(status_out, op);
  check_header(header, op);
  const SplitIo split = split_by_device(tensors, offsets, header.numel(), op);
  const std::vector<IoChunk> host_chunks = plan_io(split.host_tensors, split.host_offsets, header.numel(), op);
  const File file(fd, std::string(path), op);
  if (status.failed(reserve(file, file_size(header.numel(), tensors, offsets)))) return;
  if (status.failed(write_header(file, header))) return;
  auto pwrite_fn = [&](char* memory, size_t bytes, int64_t offset) { return ::pwrite(file.fd(), memory, bytes, offset); };
  if (status.failed(transfer_all(host_chunks, pwrite_fn, file, "write", /*writeback=*/true))) return;
  if (status.failed(write_device_chunks(split, file))) return;
  status.failed(flush_to_disk(file));
}

void read_tensors_cuda(int64_t fd, c10::string_view path, at::IntArrayRef offsets, at::TensorList outs,
                       const at::Tensor& status_out) {
  constexpr const char* op = "accel::read_tensors_";
  Status status(status_out, op);
  const SplitIo split = split_by_device(outs, offsets, 0, op);
  const std::vector<IoChunk> host_chunks = plan_io(split.host_tensors, split.host_offsets, 0, op);
  const File file(fd, std::string(path), op);
  const FileVersion before = version_of(file);
  check_covers(file, host_chunks, before);
  check_covers(file, split.device_chunks, before);
  auto pread_fn = [&](char* memory, size_t bytes, int64_t offset) { return ::pread(file.fd(), memory, bytes, offset); };
  if (status.failed(transfer_all(host_chunks, pread_fn, file, "read", /*writeback=*/false))) return;
  if (status.failed(read_device_chunks(split, file))) return;
  check_unchanged(file, before);
}

}  // namespace
}  // namespace accel

TORCH_LIBRARY_IMPL(accel, CUDA, m) {
  m.impl("write_tensors_", &accel::write_tensors_cuda);
  m.impl("read_tensors_", &accel::read_tensors_cuda);
}
