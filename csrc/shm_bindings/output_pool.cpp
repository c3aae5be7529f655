// The output pool of accel's shared-memory gathers (output_pool.h).
#include "output_pool.h"

#include <sys/mman.h>
#include <unistd.h>

#include <ATen/EmptyTensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <unordered_map>

namespace accel::transport {
namespace {

// Memory the allocator has just mapped costs a page fault per 4 KiB page at first touch, which on these machines
// is several times the copy itself (a fresh 64 MiB buffer: 37 ms to fill in 4 KiB pages, 28 ms when faulted in
// one call, 16.5 ms in transparent huge pages; 8 MiB: 3.5 / 1.65 / 0.9 ms). So before writing an output, ask for
// huge pages (from 4 MiB) and fault the pages in one call. Memory the allocator reuses is mapped already: then
// both calls only walk the page tables. Either may be unsupported (old kernel, THP off): they are hints.
void prefault(void* data, size_t bytes) {
  constexpr uintptr_t kPage = 4096, kHugePage = 2 << 20;
  constexpr size_t kHugeFrom = 4 << 20;
  const auto start = reinterpret_cast<uintptr_t>(data);
  auto inner = [&](uintptr_t align) {
    const uintptr_t begin = (start + align - 1) & ~(align - 1), end = (start + bytes) & ~(align - 1);
    return std::make_pair(reinterpret_cast<void*>(begin), end > begin ? end - begin : 0);
  };
  if (bytes >= kHugeFrom) {
    const auto [begin, length] = inner(kHugePage);
    if (length > 0) ::madvise(begin, length, MADV_HUGEPAGE);
  }
#ifdef MADV_POPULATE_WRITE
  const auto [begin, length] = inner(kPage);
  if (length > 0) ::madvise(begin, length, MADV_POPULATE_WRITE);
#endif
}

// Outputs are fresh memory on every call, which costs the faults and the kernel's zeroing above, and a user
// typically drops gathered tensors soon (a metric computed, the batch done). So the buffers such tensors free
// are kept, up to ACCEL_SHM_KEEP_BYTES in all (default 128 MiB, 0: none), and handed to the next output of the
// same size class: no faults, no zeroing, lines still in cache (a 2-rank gather of 32 MiB per rank: 29 ms
// instead of 79). Beyond the cap, and in a forked child (which must not take a lock that a thread of its parent
// may have held at the fork), buffers are simply freed.
class OutputPool final : public c10::Allocator {
 public:
  static OutputPool& instance() {
    static auto* pool = new OutputPool();  // never destroyed: tensors may be freed after static destructors
    return *pool;
  }

  c10::DataPtr allocate(size_t bytes) override {
    const size_t size = size_class(bytes);
    void* base = take(size);
    if (base == nullptr) {
      base = c10::alloc_cpu(kHeader + size);
      prefault(static_cast<std::byte*>(base) + kHeader, size);
    }
    *static_cast<size_t*>(base) = size;
    return {static_cast<std::byte*>(base) + kHeader, base, &OutputPool::release, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }

 private:
  static constexpr size_t kHeader = 64;  // the buffer's size class, before the data (which stays 64-byte aligned)

  static size_t kept_limit() {
    const char* setting = std::getenv("ACCEL_SHM_KEEP_BYTES");
    return setting != nullptr && *setting != '\0' ? std::strtoull(setting, nullptr, 10) : size_t{128} << 20;
  }

  static size_t size_class(size_t bytes) { return (std::max<size_t>(bytes, 1) + 4095) & ~size_t{4095}; }

  void* take(size_t size) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = kept_.find(size);
    if (found == kept_.end()) return nullptr;
    void* base = found->second;
    kept_.erase(found);
    kept_bytes_ -= size;
    return base;
  }

  static void release(void* base) {
    OutputPool& pool = instance();
    const size_t size = *static_cast<size_t*>(base);
    if (::getpid() == pool.pid_) {
      std::lock_guard<std::mutex> lock(pool.mutex_);
      if (pool.kept_bytes_ + size <= pool.kept_limit_) {
        pool.kept_.emplace(size, base);
        pool.kept_bytes_ += size;
        return;
      }
    }
    c10::free_cpu(base);
  }

  const pid_t pid_ = ::getpid();
  const size_t kept_limit_ = kept_limit();
  std::mutex mutex_;
  std::unordered_multimap<size_t, void*> kept_;
  size_t kept_bytes_ = 0;
};

}  // namespace

// An output of at least kPooledFrom bytes comes from the pool; smaller ones from the CPU allocator (malloc
// reuses those without faults anyway).
at::Tensor fresh_output(at::IntArrayRef shape, const at::TensorOptions& options) {
  constexpr size_t kPooledFrom = 64 << 10;
  const auto dtype = c10::typeMetaToScalarType(options.dtype());
  size_t bytes = c10::elementSize(dtype);
  bool overflows = false;
  for (const int64_t size : shape) overflows |= __builtin_mul_overflow(bytes, static_cast<size_t>(size), &bytes);
  if (bytes < kPooledFrom || overflows) return at::empty(shape, options);  // at::empty reports an overflow
  return at::detail::empty_generic(shape, &OutputPool::instance(), c10::DispatchKeySet(c10::DispatchKey::CPU), dtype,
                                   std::nullopt);
}

}  // namespace accel::transport
