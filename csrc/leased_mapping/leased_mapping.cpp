// accel::map_file_leased: a private mapping of a checkpoint file, guarded by a read lease whose breaks a C++ thread
// answers (accel/checkpoint/leased_mapping.py explains why weights are mapped and what the lease protects).
//
// Each call dups the caller's descriptor (the lease belongs to that open file), takes a read lease on it whose
// breaks are signalled to the watcher thread (F_SETSIG with a real-time signal, F_SETOWN_EX to that thread only),
// maps the file MAP_PRIVATE and returns the bytes as a uint8 tensor whose deleter unmaps them and drops the lease.
// When a writer opens the file for writing or truncates it, the kernel blocks the writer and signals the watcher,
// which copies the mapped bytes (the process's own edits included) into anonymous memory, swaps that copy in at the
// same address (mremap MREMAP_FIXED, so every tensor keeps its data pointer), and releases the lease: the writer
// proceeds and the weights stay as they were.
//
// The watcher never needs Python's GIL, unlike the Python fallback's thread: a writer in this same process that
// holds the GIL while it opens the file (torch.save's C++ file writer does) waits milliseconds, not the kernel's
// lease-break time (/proc/sys/fs/lease-break-time, 45 s by default) after which the file would change under the
// weights. One lock orders the watcher's copies against new mappings and deleters, so a copy never lands on an
// address that was unmapped (and perhaps reused) meanwhile. A forked child keeps its mappings unguarded (the
// lease is the parent's): its copies of the leased descriptors are closed, and mappings it makes start a watcher
// of its own.
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <thread>

namespace accel {
namespace {

// The lease-break signal: real-time, so breaks queue one per lease with the descriptor in si_fd (the Python
// fallback uses the same one; a process runs one or the other).
int lease_signal() { return SIGRTMAX - 5; }

size_t page_rounded(size_t bytes) {
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

struct Guard {
  int fd;  // the leased duplicate; -1 once released (the mapping may live on, now private memory)
  size_t length;  // of the mapping, whole pages
  std::string path;  // for the warning
};

class Watcher {
 public:
  static Watcher& instance() {
    static Watcher* watcher = [] {
      auto* created = new Watcher();  // never destroyed: deleters of tensors may run at exit
      ::pthread_atfork([] { instance().mutex_.lock(); }, [] { instance().mutex_.unlock(); },
                       [] { instance().after_fork_in_child(); });
      return created;
    }();
    return *watcher;
  }

  // `size` bytes of `fd` mapped privately under a read lease, or an undefined tensor when no lease can be taken.
  at::Tensor map(int64_t fd, int64_t size, const std::string& path) {
    std::lock_guard<std::mutex> lock(mutex_);  // a break during set-up is answered once the mapping is registered
    const pid_t tid = watcher_tid();
    const int leased = lease(static_cast<int>(fd), static_cast<size_t>(size), tid);
    if (leased < 0) return at::Tensor();
    void* address = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE, MAP_PRIVATE, leased, 0);
    if (address == MAP_FAILED) {
      const int error = errno;
      drop_lease(leased);
      TORCH_CHECK(false, "accel::map_file_leased: cannot map '", path, "': ", std::strerror(error));
    }
    guards_[address] = Guard{leased, page_rounded(static_cast<size_t>(size)), path};
    return at::from_blob(address, {size}, [](void* data) { instance().unmap(data); },
                         at::TensorOptions().dtype(at::kByte));
  }

 private:
  Watcher() = default;

  // A duplicate of `fd` holding a read lease whose breaks signal thread `tid`, once the file is known to hold `size`
  // bytes (from then on nobody can shorten it without breaking the lease first); -1 where that cannot be had.
  static int lease(int fd, size_t size, pid_t tid) {
    const int leased = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (leased < 0) return -1;
    f_owner_ex owner{F_OWNER_TID, tid};
    struct stat st {};
    const bool ok = ::fcntl(leased, F_SETSIG, lease_signal()) == 0 && ::fcntl(leased, F_SETOWN_EX, &owner) == 0 &&
                    ::fcntl(leased, F_SETLEASE, F_RDLCK) == 0;
    if (!ok) {
      ::close(leased);
      return -1;
    }
    if (::fstat(leased, &st) != 0 || static_cast<size_t>(st.st_size) < size) {
      drop_lease(leased);
      return -1;
    }
    return leased;
  }

  static void drop_lease(int fd) {
    ::fcntl(fd, F_SETLEASE, F_UNLCK);
    ::close(fd);
  }

  // The watcher thread's id, starting the thread on first use (and again in a forked child). Under mutex_.
  pid_t watcher_tid() {
    if (tid_ == 0) {
      std::promise<pid_t> started;
      std::future<pid_t> tid = started.get_future();
      std::thread([this, started = std::move(started)]() mutable {
        sigset_t set;
        sigemptyset(&set);
        sigaddset(&set, lease_signal());
        ::pthread_sigmask(SIG_BLOCK, &set, nullptr);  // before any lease names this thread
        started.set_value(static_cast<pid_t>(::syscall(SYS_gettid)));
        answer_breaks(set);
      }).detach();
      tid_ = tid.get();
    }
    return tid_;
  }

  [[noreturn]] void answer_breaks(const sigset_t& set) {
    while (true) {
      siginfo_t info{};
      if (::sigwaitinfo(&set, &info) < 0) continue;  // EINTR
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& [address, guard] : guards_) {
        // A lease being broken reports the type it falls to; a stale signal for a reused descriptor does not.
        if (guard.fd == info.si_fd && ::fcntl(guard.fd, F_GETLEASE) != F_RDLCK) detach(address, guard);
      }
    }
  }

  // How much of the mapping the file still backs, in whole pages (reading past it raises SIGBUS): all of it while
  // the lease holds; less only if the kernel broke the lease itself, this thread having been held up for longer
  // than the lease-break time.
  static size_t backed_bytes(const Guard& guard) {
    struct stat st {};
    if (::fstat(guard.fd, &st) != 0) return 0;
    return std::min(guard.length, page_rounded(static_cast<size_t>(st.st_size)));
  }

  // Swaps a private copy of the mapping in at its address (zeros past the file's end), then lets the writer go.
  static void detach(void* address, Guard& guard) {
    void* copy = ::mmap(nullptr, guard.length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE,
                        -1, 0);
    bool copied = false;
    if (copy != MAP_FAILED) {
      std::memcpy(copy, address, backed_bytes(guard));
      copied = ::mremap(copy, guard.length, guard.length, MREMAP_MAYMOVE | MREMAP_FIXED, address) == address;
    }
    if (copied) {
      TORCH_WARN("'", guard.path, "' is being written by another program: the weights mapped from it were copied ",
                 "into memory first, so they do not change");
    } else {
      if (copy != MAP_FAILED) ::munmap(copy, guard.length);
      TORCH_WARN("'", guard.path, "' is being written by another program, and no memory could be had to copy the ",
                 "weights mapped from it: they may change");
    }
    drop_lease(guard.fd);
    guard.fd = -1;
  }

  void unmap(void* address) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto found = guards_.find(address);
    if (found == guards_.end()) return;
    ::munmap(address, found->second.length);
    if (found->second.fd >= 0) drop_lease(found->second.fd);
    guards_.erase(found);
  }

  // The watcher did not survive the fork and the leases are the parent's: forget them (closing this process's
  // duplicates only; unlocking would drop the parent's lease) and start a new watcher when this process maps.
  void after_fork_in_child() {
    for (auto& [address, guard] : guards_) {
      if (guard.fd >= 0) ::close(guard.fd);
      guard.fd = -1;
    }
    tid_ = 0;
    mutex_.unlock();
  }

  std::mutex mutex_;
  std::map<void*, Guard> guards_;  // by address: one mapping per lease
  pid_t tid_ = 0;
};

at::Tensor map_file_leased(int64_t fd, int64_t size, c10::string_view path) {
  TORCH_CHECK(size > 0, "accel::map_file_leased: size must be positive, got ", size);
  at::Tensor mapped = Watcher::instance().map(fd, size, std::string(path));
  return mapped.defined() ? mapped : at::empty({0}, at::TensorOptions().dtype(at::kByte));
}

}  // namespace
}  // namespace accel

// No tensor goes in (a descriptor does), so the op is registered for every backend; the mapping is CPU memory.
TORCH_LIBRARY_IMPL(accel, CompositeExplicitAutograd, m) { m.impl("map_file_leased", &accel::map_file_leased); }
