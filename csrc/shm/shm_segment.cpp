#include "shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <stdexcept>
#include <system_error>
#include <utility>

namespace accel::shm {
namespace {

constexpr unsigned long long kMiB = 1ull << 20;
// Left available beyond the segment, so that creating it cannot starve everything else on the machine.
constexpr unsigned long long kFreeMemoryMargin = 64 * kMiB;
constexpr mode_t kOwnerOnly = 0600;
// Sealed once sized: no process (a buggy or hostile peer included) can shrink the file under the others'
// mappings, which would turn their reads into SIGBUS, or unseal it.
constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;

[[noreturn]] void throw_system(const std::string& name, const char* call, int err) {
  throw Error(ErrorKind::Setup, -1,
              "shared-memory segment " + name + ": " + call + " failed: " + std::system_category().message(err));
}

unsigned long long mib_rounded_up(unsigned long long bytes) { return bytes / kMiB + (bytes % kMiB != 0); }

// Closes the descriptor on every path out of create() and open(), unless released to the Segment.
class ScopedFd {
 public:
  explicit ScopedFd(int fd) noexcept : fd_(fd) {}
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const noexcept { return fd_; }
  int release() noexcept { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

bool is_lower_hex(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

void check_name(const std::string& name) {
  if (!is_segment_name(name)) {
    throw std::invalid_argument("invalid shared-memory segment name '" + name +
                                "': expected accel-<16 to 64 lowercase hex digits>-r<rank>");
  }
}

// MemAvailable from /proc/meminfo in bytes; 0 when unknown.
unsigned long long available_memory() {
  std::FILE* file = std::fopen("/proc/meminfo", "re");
  if (file == nullptr) return 0;
  char line[256];
  unsigned long long kib = 0;
  while (std::fgets(line, sizeof line, file) != nullptr) {
    if (std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1) break;
  }
  std::fclose(file);
  return kib * 1024;
}

// Fails early with a message saying what to do. The pages of a memfd come from memory, not from a sized
// tmpfs such as /dev/shm: reserving more than is available would not fail but push the machine into the OOM
// killer, so the size is checked against MemAvailable first.
void check_free_memory(size_t bytes) {
  const unsigned long long available = available_memory();
  if (available == 0 || (bytes <= available && available - bytes >= kFreeMemoryMargin)) return;
  throw Error(ErrorKind::Setup, -1,
              "shared-memory transport needs " + std::to_string(mib_rounded_up(bytes)) + " MiB of memory, only " +
                  std::to_string(available / kMiB) + " MiB available; set ACCEL_TRANSPORT=torch or lower " +
                  "ACCEL_SHM_SLOT_BYTES");
}

// posix_fallocate makes the kernel hand out every page now: running out fails here, not later as a SIGBUS
// in whichever rank first touches a missing page.
void reserve_pages(int fd, const std::string& name, size_t bytes) {
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) throw_system(name, "ftruncate", errno);
  const int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err == ENOSPC || err == ENOMEM) {
    throw Error(ErrorKind::Setup, -1,
                "shared-memory transport could not reserve " + std::to_string(mib_rounded_up(bytes)) +
                    " MiB of memory; set ACCEL_TRANSPORT=torch or lower ACCEL_SHM_SLOT_BYTES");
  }
  if (err != 0) throw_system(name, "posix_fallocate", err);
}

std::string proc_path(const Locator& locator) {
  return "/proc/" + std::to_string(locator.pid) + "/fd/" + std::to_string(locator.fd);
}

// What /proc/<pid>/fd/<fd> points to, e.g. "/memfd:accel-<token>-r1 (deleted)"; empty when unreadable.
std::string link_target(const std::string& path) {
  char target[256];
  const ssize_t n = ::readlink(path.c_str(), target, sizeof target - 1);
  return n > 0 ? std::string(target, static_cast<size_t>(n)) : std::string();
}

// A peer's segment must be the memfd named for it, sealed, exactly the size both sides computed, and
// owner-only of this user: anything else is a segment of another group, another build, or someone else's.
void check_peer_segment(int fd, const std::string& path, const std::string& name, size_t expected_bytes) {
  const std::string target = link_target(path);
  if (target != "/memfd:" + name + " (deleted)") {
    throw Error(ErrorKind::Setup, -1, path + " is '" + target + "', not the shared-memory segment " + name);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw_system(name, "fstat", errno);
  if (st.st_uid != ::geteuid() || (st.st_mode & 0777) != kOwnerOnly) {
    throw Error(ErrorKind::Setup, -1, "shared-memory segment " + name +
                                          " is not an owner-only (0600) segment of this user; refusing to map it");
  }
  if ((::fcntl(fd, F_GET_SEALS) & kSeals) != kSeals) {
    throw Error(ErrorKind::Setup, -1, "shared-memory segment " + name + " is not sealed; refusing to map it");
  }
  if (static_cast<unsigned long long>(st.st_size) != expected_bytes) {
    throw Error(ErrorKind::Setup, -1,
                "shared-memory segment " + name + " has " + std::to_string(st.st_size) + " bytes, expected " +
                    std::to_string(expected_bytes) + " (do all ranks use the same slot size?)");
  }
}

// One mapping per file per process, so that ranks sharing a process (threads in the C++ tests) see each
// segment at one address. ThreadSanitizer tracks addresses: across two mappings of one segment it would see
// neither the synchronisation nor the races of the protocol. Keyed by inode: every memfd has its own.
class MappingRegistry {
 public:
  static MappingRegistry& instance() {
    static auto* registry = new MappingRegistry();  // never destroyed: Segments may outlive static destructors
    return *registry;
  }

  std::shared_ptr<std::byte> map(int fd, const std::string& name, size_t bytes) {
    struct stat st {};
    if (::fstat(fd, &st) != 0) throw_system(name, "fstat", errno);
    const FileId id{st.st_dev, st.st_ino};
    std::lock_guard<std::mutex> lock(mutex_);
    forget_unmapped();
    std::weak_ptr<std::byte>& entry = mappings_[id];
    if (std::shared_ptr<std::byte> existing = entry.lock()) return existing;
    std::shared_ptr<std::byte> mapping = map_new(fd, name, bytes);
    entry = mapping;
    return mapping;
  }

 private:
  using FileId = std::pair<dev_t, ino_t>;

  // MADV_DONTFORK: a child forked later (DataLoader workers) gets no mapping at all, so it can neither write
  // into the ranks' slots nor keep the memory alive. Only the process that mapped it unmaps it: in a forked
  // child the range is free and may hold something else by then.
  static std::shared_ptr<std::byte> map_new(int fd, const std::string& name, size_t bytes) {
    void* addr = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (addr == MAP_FAILED) throw_system(name, "mmap", errno);
    if (::madvise(addr, bytes, MADV_DONTFORK) != 0) {
      const int err = errno;
      ::munmap(addr, bytes);
      throw_system(name, "madvise(MADV_DONTFORK)", err);
    }
    const pid_t mapped_by = ::getpid();
    return std::shared_ptr<std::byte>(static_cast<std::byte*>(addr), [bytes, mapped_by](std::byte* data) {
      if (::getpid() == mapped_by) ::munmap(data, bytes);
    });
  }

  void forget_unmapped() {
    for (auto it = mappings_.begin(); it != mappings_.end();) {
      it = it->second.expired() ? mappings_.erase(it) : std::next(it);
    }
  }

  std::mutex mutex_;
  std::map<FileId, std::weak_ptr<std::byte>> mappings_;
};

// memfd_create applies no umask, but a file's mode is the creator's to narrow: 0600 whatever it was.
void make_owner_only(int fd, const std::string& name) {
  if (::fchmod(fd, kOwnerOnly) != 0) throw_system(name, "fchmod", errno);
}

}  // namespace

bool is_segment_name(const std::string& name) {
  const std::string prefix = "accel-";
  if (name.compare(0, prefix.size(), prefix) != 0) return false;
  size_t i = prefix.size();
  const size_t hex_begin = i;
  while (i < name.size() && is_lower_hex(name[i])) ++i;
  const size_t hex_digits = i - hex_begin;
  if (hex_digits < 16 || hex_digits > 64 || name.compare(i, 2, "-r") != 0) return false;
  const size_t rank_digits = name.size() - (i + 2);
  if (rank_digits < 1 || rank_digits > 3) return false;
  for (i += 2; i < name.size(); ++i) {
    if (!is_digit(name[i])) return false;
  }
  return true;
}

Segment Segment::create(const std::string& name, size_t bytes) {
  check_name(name);
  if (bytes == 0) throw std::invalid_argument("shared-memory segment " + name + ": size must be positive");
  check_free_memory(bytes);
  ScopedFd fd(::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (fd.get() < 0) throw_system(name, "memfd_create", errno);
  make_owner_only(fd.get(), name);
  reserve_pages(fd.get(), name, bytes);
  if (::fcntl(fd.get(), F_ADD_SEALS, kSeals) != 0) throw_system(name, "fcntl(F_ADD_SEALS)", errno);
  std::shared_ptr<std::byte> mapping = MappingRegistry::instance().map(fd.get(), name, bytes);
  return Segment(name, std::move(mapping), bytes, fd.release());
}

Segment Segment::open(const Locator& locator, const std::string& name, size_t expected_bytes) {
  check_name(name);
  const std::string path = proc_path(locator);
  ScopedFd fd(::open(path.c_str(), O_RDWR | O_CLOEXEC));
  if (fd.get() < 0 && errno == ENOENT) {
    throw Error(ErrorKind::Setup, -1,
                "shared-memory segment " + name + " cannot be opened: its process (pid " +
                    std::to_string(locator.pid) + ") is not running or no longer holds it (" + path + ")");
  }
  if (fd.get() < 0) throw_system(name, ("open(" + path + ")").c_str(), errno);
  check_peer_segment(fd.get(), path, name, expected_bytes);
  return Segment(name, MappingRegistry::instance().map(fd.get(), name, expected_bytes), expected_bytes, -1);
}

Segment::Segment(std::string name, std::shared_ptr<std::byte> mapping, size_t size, int fd) noexcept
    : name_(std::move(name)), mapping_(std::move(mapping)), size_(size), fd_(fd) {}

Segment::Segment(Segment&& other) noexcept
    : name_(std::move(other.name_)),
      mapping_(std::move(other.mapping_)),
      size_(std::exchange(other.size_, 0)),
      fd_(std::exchange(other.fd_, -1)) {}

Segment& Segment::operator=(Segment&& other) noexcept {
  if (this != &other) {
    close_descriptor();
    name_ = std::move(other.name_);
    mapping_ = std::move(other.mapping_);
    size_ = std::exchange(other.size_, 0);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

Segment::~Segment() { close_descriptor(); }

Locator Segment::locator() const {
  if (fd_ < 0) {
    throw Error(ErrorKind::Usage, -1,
                "shared-memory segment " + name_ + " has no locator: opened from a peer, or its descriptor is closed");
  }
  return Locator{static_cast<int64_t>(::getpid()), fd_};
}

void Segment::close_descriptor() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

}  // namespace accel::shm
