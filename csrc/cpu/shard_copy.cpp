// CPU kernels of accel::write_tensors_ and accel::read_tensors_: the byte mover of the safetensors writer and
// reader (accel/checkpoint/safetensors_io.py plans headers and offsets and validates every header it reads).
//
// Writing: the file is created, its full size reserved with posix_fallocate (a full disk fails here, before any
// data moves, instead of as a short write halfway), then the header and every tensor's bytes are written straight
// from the tensors' memory with pwrite, in chunks of 8 MiB spread over torch's threads, then fsync'd. Reading is
// the same in reverse with pread, straight into the destination tensors. No intermediate buffers either way.
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace accel {
namespace {

constexpr int64_t kChunkBytes = 8 << 20;  // large enough for the disk, small enough to spread over threads

// One piece of I/O: `bytes` at file offset `file_offset` from/to `memory`.
struct IoChunk {
  char* memory;
  int64_t file_offset;
  int64_t bytes;
  int64_t tensor;  // index in the caller's list, for error messages
};

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

// Closes the descriptor on every path; `unlink_on_failure` removes a half-written file.
class File {
 public:
  File(const std::string& path, int flags, bool unlink_on_failure)
      : path_(path), unlink_on_failure_(unlink_on_failure) {
    fd_ = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
    TORCH_CHECK(fd_ >= 0, "cannot open '", path, "': ", errno_text(errno));
  }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_ && unlink_on_failure_) ::unlink(path_.c_str());
  }
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  void commit() { committed_ = true; }

 private:
  std::string path_;
  bool unlink_on_failure_;
  bool committed_ = false;
  int fd_ = -1;
};

// The first failure of any thread, reported once all threads are done.
class FirstError {
 public:
  void set(std::string message) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failed_.exchange(true)) message_ = std::move(message);
  }
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  void raise_if_failed() {
    TORCH_CHECK(!failed_, message_);
  }

 private:
  std::mutex mutex_;
  std::atomic<bool> failed_{false};
  std::string message_;
};

std::vector<IoChunk> plan_io(at::TensorList tensors, at::IntArrayRef offsets, int64_t base, const char* op) {
  TORCH_CHECK(offsets.size() == tensors.size(), op, ": ", tensors.size(), " tensors but ", offsets.size(), " offsets");
  std::vector<IoChunk> chunks;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.device().is_cpu(), op, ": tensors[", i, "] is on ", t.device(), "; move it to the CPU first");
    TORCH_CHECK(t.is_contiguous(), op, ": tensors[", i, "] is not contiguous");
    TORCH_CHECK(offsets[i] >= 0, op, ": offsets[", i, "] is negative");
    const int64_t nbytes = t.numel() * t.element_size();
    auto* memory = static_cast<char*>(t.data_ptr());
    for (int64_t done = 0; done < nbytes; done += kChunkBytes) {
      chunks.push_back({memory + done, base + offsets[i] + done, std::min(kChunkBytes, nbytes - done),
                        static_cast<int64_t>(i)});
    }
  }
  return chunks;
}

// Asks the kernel to start writing a chunk back to disk now rather than when the final fsync asks: the disk then
// works while later chunks are still being copied into the page cache, and the fsync only waits for the tail.
void start_writeback(const File& file, const IoChunk& c) {
#if defined(__linux__)
  ::sync_file_range(file.fd(), c.file_offset, c.bytes, SYNC_FILE_RANGE_WRITE);  // a hint: errors surface in fsync
#else
  (void)file;
  (void)c;
#endif
}

// pwrite/pread the whole chunk, retrying short transfers and EINTR.
template <typename Transfer>
void transfer_chunk(const IoChunk& c, Transfer transfer, const File& file, const char* verb, FirstError& error) {
  int64_t done = 0;
  while (done < c.bytes && !error.failed()) {
    const ssize_t n = transfer(c.memory + done, static_cast<size_t>(c.bytes - done), c.file_offset + done);
    if (n > 0) {
      done += n;
    } else if (n == 0) {
      error.set("'" + file.path() + "' ended early while reading tensor " + std::to_string(c.tensor) + " (at byte " +
                std::to_string(c.file_offset + done) + "): the file is truncated");
      return;
    } else if (errno != EINTR) {
      error.set(std::string("cannot ") + verb + " '" + file.path() + "' (tensor " + std::to_string(c.tensor) +
                "): " + errno_text(errno));
      return;
    }
  }
}

template <typename Transfer>
void transfer_all(const std::vector<IoChunk>& chunks, Transfer transfer, const File& file, const char* verb,
                  bool writeback) {
  FirstError error;
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      transfer_chunk(chunks[i], transfer, file, verb, error);
      if (writeback) start_writeback(file, chunks[i]);
    }
  });
  error.raise_if_failed();
}

void write_tensors_cpu(c10::string_view path, const at::Tensor& header, at::TensorList tensors,
                       at::IntArrayRef offsets) {
  constexpr const char* op = "accel::write_tensors_";
  TORCH_CHECK(header.device().is_cpu() && header.scalar_type() == at::kByte && header.dim() == 1 &&
                  header.is_contiguous(),
              op, ": header must be a contiguous 1-d uint8 CPU tensor");
  const int64_t base = header.numel();
  const std::vector<IoChunk> chunks = plan_io(tensors, offsets, base, op);
  int64_t total = base;
  for (size_t i = 0; i < tensors.size(); ++i) {
    total = std::max(total, base + offsets[i] + tensors[i].numel() * tensors[i].element_size());
  }
  File file(std::string(path), O_WRONLY | O_CREAT | O_TRUNC, /*unlink_on_failure=*/true);
  if (total > 0) {
    const int err = ::posix_fallocate(file.fd(), 0, total);
    // EOPNOTSUPP / EINVAL: a filesystem that cannot reserve space; the writes below still report a full disk.
    TORCH_CHECK(err == 0 || err == EOPNOTSUPP || err == EINVAL, "cannot reserve ", total, " bytes for '", file.path(),
                "': ", errno_text(err));
  }
  auto pwrite_fn = [&](char* memory, size_t bytes, int64_t offset) { return ::pwrite(file.fd(), memory, bytes, offset); };
  const IoChunk header_chunk{static_cast<char*>(header.data_ptr()), 0, base, -1};
  FirstError header_error;
  transfer_chunk(header_chunk, pwrite_fn, file, "write", header_error);
  header_error.raise_if_failed();
  transfer_all(chunks, pwrite_fn, file, "write", /*writeback=*/true);
  TORCH_CHECK(::fsync(file.fd()) == 0, "cannot flush '", file.path(), "' to disk: ", errno_text(errno));
  file.commit();
}

void read_tensors_cpu(c10::string_view path, at::IntArrayRef offsets, at::TensorList outs) {
  constexpr const char* op = "accel::read_tensors_";
  const std::vector<IoChunk> chunks = plan_io(outs, offsets, 0, op);
  File file(std::string(path), O_RDONLY, /*unlink_on_failure=*/false);
  auto pread_fn = [&](char* memory, size_t bytes, int64_t offset) { return ::pread(file.fd(), memory, bytes, offset); };
  transfer_all(chunks, pread_fn, file, "read", /*writeback=*/false);
  file.commit();
}

}  // namespace
}  // namespace accel

TORCH_LIBRARY_IMPL(accel, CPU, m) {
  m.impl("write_tensors_", &accel::write_tensors_cpu);
  m.impl("read_tensors_", &accel::read_tensors_cpu);
}
