// CPU kernels of accel::write_tensors_ and accel::read_tensors_: the byte mover of the safetensors writer and
// reader (accel/checkpoint/safetensors_io.py plans headers and offsets and validates every header it reads).
//
// Both take the caller's open file descriptor. Writing: the file's full size is reserved with fallocate (a full
// disk fails here, before any data moves, instead of as a short write halfway), then the header and every tensor's
// bytes are written straight from the tensors' memory with pwrite, in chunks of 8 MiB spread over torch's threads,
// then fsync'd. Reading is the same in reverse with pread, straight into the destination tensors. No intermediate
// buffers either way. A failed system call is returned in `status` (errno, tensor); a read raises, naming the
// file, when the file is too short for what is asked or changed (size, mtime) while being read.
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

void write_tensors_cpu(int64_t fd, c10::string_view path, const at::Tensor& header, at::TensorList tensors,
                       at::IntArrayRef offsets, const at::Tensor& status_out) {
  constexpr const char* op = "accel::write_tensors_";
  Status status(status_out, op);
  check_header(header, op);
  check_on_cpu(tensors, op);
  const std::vector<IoChunk> chunks = plan_io(tensors, offsets, header.numel(), op);
  const File file(fd, std::string(path), op);
  if (status.failed(reserve(file, file_size(header.numel(), tensors, offsets)))) return;
  if (status.failed(write_header(file, header))) return;
  auto pwrite_fn = [&](char* memory, size_t bytes, int64_t offset) { return ::pwrite(file.fd(), memory, bytes, offset); };
  if (status.failed(transfer_all(chunks, pwrite_fn, file, "write", /*writeback=*/true))) return;
  status.failed(flush_to_disk(file));
}

void read_tensors_cpu(int64_t fd, c10::string_view path, at::IntArrayRef offsets, at::TensorList outs,
                      const at::Tensor& status_out) {
  constexpr const char* op = "accel::read_tensors_";
  Status status(status_out, op);
  check_on_cpu(outs, op);
  const std::vector<IoChunk> chunks = plan_io(outs, offsets, 0, op);
  const File file(fd, std::string(path), op);
  const FileVersion before = version_of(file);
  check_covers(file, chunks, before);
  auto pread_fn = [&](char* memory, size_t bytes, int64_t offset) { return ::pread(file.fd(), memory, bytes, offset); };
  if (status.failed(transfer_all(chunks, pread_fn, file, "read", /*writeback=*/false))) return;
  check_unchanged(file, before);
}

}  // namespace
}  // namespace accel

TORCH_LIBRARY_IMPL(accel, CPU, m) {
  m.impl("write_tensors_", &accel::write_tensors_cpu);
  m.impl("read_tensors_", &accel::read_tensors_cpu);
}
