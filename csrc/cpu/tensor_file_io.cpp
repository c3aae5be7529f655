// CPU kernels of accel::write_tensors_ and accel::read_tensors_: the byte mover of the safetensors writer and
// reader (accel/checkpoint/safetensors_io.py plans headers and offsets and validates every header it reads).
//
// Writing: the file is created, its full size reserved with posix_fallocate (a full disk fails here, before any
// data moves, instead of as a short write halfway), then the header and every tensor's bytes are written straight
// from the tensors' memory with pwrite, in chunks of 8 MiB spread over torch's threads, then fsync'd. Reading is
// the same in reverse with pread, straight into the destination tensors. No intermediate buffers either way. A read
// fails, naming the file, when the file is too short for what is asked or changed (size, mtime) while being read.
#include "../tensor_file_io.h"

#include <torch/library.h>

namespace accel {
namespace {

using namespace tensor_file_io;

void check_on_cpu(at::TensorList tensors, const char* op) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].device().is_cpu(), op, ": tensors[", i, "] is on ", tensors[i].device(),
                "; move it to the CPU first");
  }
}

void write_tensors_cpu(c10::string_view path, const at::Tensor& header, at::TensorList tensors,
                       at::IntArrayRef offsets) {
  constexpr const char* op = "accel::write_tensors_";
  check_header(header, op);
  check_on_cpu(tensors, op);
  const std::vector<IoChunk> chunks = plan_io(tensors, offsets, header.numel(), op);
  File file(std::string(path), O_WRONLY | O_CREAT | O_TRUNC, /*unlink_on_failure=*/true);
  reserve(file, file_size(header.numel(), tensors, offsets));
  write_header(file, header);
  auto pwrite_fn = [&](char* memory, size_t bytes, int64_t offset) { return ::pwrite(file.fd(), memory, bytes, offset); };
  transfer_all(chunks, pwrite_fn, file, "write", /*writeback=*/true);
  finish_write(file);
}

void read_tensors_cpu(c10::string_view path, at::IntArrayRef offsets, at::TensorList outs) {
  constexpr const char* op = "accel::read_tensors_";
  check_on_cpu(outs, op);
  const std::vector<IoChunk> chunks = plan_io(outs, offsets, 0, op);
  File file(std::string(path), O_RDONLY, /*unlink_on_failure=*/false);
  const FileVersion before = version_of(file);
  check_covers(file, chunks, before);
  auto pread_fn = [&](char* memory, size_t bytes, int64_t offset) { return ::pread(file.fd(), memory, bytes, offset); };
  transfer_all(chunks, pread_fn, file, "read", /*writeback=*/false);
  check_unchanged(file, before);
  file.commit();
}

}  // namespace
}  // namespace accel

TORCH_LIBRARY_IMPL(accel, CPU, m) {
  m.impl("write_tensors_", &accel::write_tensors_cpu);
  m.impl("read_tensors_", &accel::read_tensors_cpu);
}
