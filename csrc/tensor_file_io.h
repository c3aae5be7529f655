// Shared by cpu/tensor_file_io.cpp and cuda/tensor_file_io.cu: the caller's file, the status a failed system call
// is returned in, error collection across threads and the chunked pwrite/pread of accel::write_tensors_ /
// accel::read_tensors_. Host code only.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

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

namespace accel::tensor_file_io {


constexpr int64_t kChunkBytes = 8 << 20;  // large enough for the disk, small enough to spread over threads

// One piece of I/O: `bytes` at file offset `file_offset` from/to `memory`.
struct IoChunk {
  char* memory;
  int64_t file_offset;
  int64_t bytes;
  int64_t tensor;  // index in the caller's list, for error messages
};

// A failed system call: its errno and the tensor whose bytes it moved (-1: the file as a whole). err == 0: none.
struct SysError {
  int err = 0;
  int64_t tensor = -1;
  explicit operator bool() const { return err != 0; }
};

// The op's `status` argument, a CPU int64 tensor of two: {errno, tensor} of the first failed system call, {0, -1}
// when none failed. A system call's failure is a value the caller turns into an OSError (as os.pwrite would raise),
// not text to parse; bad arguments and files whose contents do not fit raise.
class Status {
 public:
  Status(const at::Tensor& status, const char* op) {
    TORCH_CHECK(status.device().is_cpu() && status.scalar_type() == at::kLong && status.numel() == 2 &&
                    status.is_contiguous(),
                op, ": status must be a contiguous CPU int64 tensor of 2 elements");
    data_ = status.data_ptr<int64_t>();
    data_[0] = 0;
    data_[1] = -1;
  }
  // Records `error`; true when it is one (the op then returns).
  bool failed(SysError error) {
    if (!error) return false;
    data_[0] = error.err;
    data_[1] = error.tensor;
    return true;
  }

 private:
  int64_t* data_;
};

// The caller's open file: the op reads or writes the descriptor it is given (the very file the caller created or
// opened and checked), never a path it would reopen. `path` names it in messages. The caller closes it.
class File {
 public:
  File(int64_t fd, std::string path, const char* op) : fd_(static_cast<int>(fd)), path_(std::move(path)) {
    TORCH_CHECK(fd >= 0 && fd <= INT32_MAX, op, ": fd must be an open file descriptor, got ", fd);
  }
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

 private:
  int fd_;
  std::string path_;
};

inline std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

// Which file, at which contents: a writer that replaces the file keeps the path but not the inode; one that truncates
// or rewrites it in place moves its size or mtime. Checked around a read, so that bytes of a file that changed while
// they were read are never handed out as a checkpoint.
struct FileVersion {
  dev_t device;
  ino_t inode;
  off_t size;
  struct timespec mtime;

  bool operator==(const FileVersion& other) const {
    return device == other.device && inode == other.inode && size == other.size &&
           mtime.tv_sec == other.mtime.tv_sec && mtime.tv_nsec == other.mtime.tv_nsec;
  }
};

inline FileVersion version_of(const File& file) {
  struct stat info {};
  const int err = ::fstat(file.fd(), &info) == 0 ? 0 : errno;
  TORCH_CHECK(err == 0, "cannot stat '", file.path(), "': ", errno_text(err));
#if defined(__APPLE__)
  return FileVersion{info.st_dev, info.st_ino, info.st_size, info.st_mtimespec};
#else
  return FileVersion{info.st_dev, info.st_ino, info.st_size, info.st_mtim};
#endif
}

inline void check_unchanged(const File& file, const FileVersion& before) {
  TORCH_CHECK(version_of(file) == before, "'", file.path(), "' was truncated or rewritten while it was being read: ",
              "another process is writing it; read it again once that writer is done");
}

// Before any byte moves: every chunk lies inside the file (a truncated file is named, not half read).
inline void check_covers(const File& file, const std::vector<IoChunk>& chunks, const FileVersion& version) {
  for (const IoChunk& c : chunks) {
    TORCH_CHECK(c.file_offset + c.bytes <= version.size, "'", file.path(), "' ended early (tensor ", c.tensor,
                " needs bytes up to ", c.file_offset + c.bytes, ", the file has ", version.size,
                "): the file is truncated");
  }
}

// The first failure of any thread, reported once all threads are done: a failed system call is returned, a
// file that ended early raises.
class FirstError {
 public:
  void set(std::string message) { first([&] { message_ = std::move(message); }); }
  void set(SysError error) { first([&] { sys_ = error; }); }
  bool failed() const { return failed_.load(std::memory_order_relaxed); }
  SysError raise_or_return() {
    TORCH_CHECK(message_.empty(), message_);
    return sys_;
  }

 private:
  template <typename Record>
  void first(Record record) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failed_.exchange(true)) record();
  }
  std::mutex mutex_;
  std::atomic<bool> failed_{false};
  std::string message_;
  SysError sys_;
};

inline std::vector<IoChunk> plan_io(at::TensorList tensors, at::IntArrayRef offsets, int64_t base, const char* op) {
  TORCH_CHECK(offsets.size() == tensors.size(), op, ": ", tensors.size(), " tensors but ", offsets.size(), " offsets");
  std::vector<IoChunk> chunks;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.is_contiguous(), op, ": tensors[", i, "] is not contiguous");
    TORCH_CHECK(!t.is_conj() && !t.is_neg(), op, ": tensors[", i, "] is a conjugate or negative view (its memory does ",
                "not hold its values); resolve_conj() and resolve_neg() it first");
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
inline void start_writeback(const File& file, const IoChunk& c) {
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
    const int err = errno;  // before anything below can change it
    if (n > 0) {
      done += n;
    } else if (n == 0) {
      error.set(std::string("'") + file.path() + "' ended early (" + verb + ", tensor " + std::to_string(c.tensor) +
                ", at byte " + std::to_string(c.file_offset + done) + "): the file is truncated");
      return;
    } else if (err != EINTR) {
      error.set(SysError{err, c.tensor});
      return;
    }
  }
}

template <typename Transfer>
SysError transfer_all(const std::vector<IoChunk>& chunks, Transfer transfer, const File& file, const char* verb,
                      bool writeback) {
  FirstError error;
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      transfer_chunk(chunks[i], transfer, file, verb, error);
      if (writeback) start_writeback(file, chunks[i]);
    }
  });
  return error.raise_or_return();
}

// Reserves `total` bytes for the file, so that a full disk fails here, before any data moves. fallocate(2)
// itself, not posix_fallocate: where a filesystem cannot reserve space (NFSv3, ZFS...), glibc's emulation writes a
// byte per block, which costs more than it saves; the writes still report a full disk there.
inline SysError reserve(const File& file, int64_t total) {
  if (total <= 0) return {};
#if defined(__linux__)
  const int err = ::fallocate(file.fd(), 0, 0, total) == 0 ? 0 : errno;
#else
  const int err = ::posix_fallocate(file.fd(), 0, total);
#endif
  const bool unsupported = err == EOPNOTSUPP || err == ENOSYS || err == EINVAL;  // the writes report a full disk
  return SysError{unsupported ? 0 : err, -1};
}

// Bytes the file needs: the header plus the end of the furthest tensor.
inline int64_t file_size(int64_t header_bytes, at::TensorList tensors, at::IntArrayRef offsets) {
  int64_t total = header_bytes;
  for (size_t i = 0; i < tensors.size(); ++i) {
    total = std::max(total, header_bytes + offsets[i] + tensors[i].numel() * tensors[i].element_size());
  }
  return total;
}

inline void check_header(const at::Tensor& header, const char* op) {
  TORCH_CHECK(header.device().is_cpu() && header.scalar_type() == at::kByte && header.dim() == 1 &&
                  header.is_contiguous(),
              op, ": header must be a contiguous 1-d uint8 CPU tensor");
}

inline SysError write_header(const File& file, const at::Tensor& header) {
  auto pwrite_fn = [&](char* memory, size_t bytes, int64_t offset) { return ::pwrite(file.fd(), memory, bytes, offset); };
  FirstError error;
  transfer_chunk(IoChunk{static_cast<char*>(header.data_ptr()), 0, header.numel(), -1}, pwrite_fn, file, "write", error);
  return error.raise_or_return();
}

inline SysError flush_to_disk(const File& file) { return SysError{::fsync(file.fd()) == 0 ? 0 : errno, -1}; }

}  // namespace accel::tensor_file_io
