#include "shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <iterator>
#include <map>
#include <mutex>
#include <stdexcept>
#include <system_error>
#include <utility>

namespace accel::shm {
namespace {

constexpr unsigned long long kMiB = 1ull << 20;
// Left free in /dev/shm beyond the segment, so that creating it cannot starve everything else using it.
constexpr unsigned long long kFreeSpaceMargin = kMiB;
constexpr mode_t kOwnerOnly = 0600;

[[noreturn]] void throw_system(const std::string& name, const char* call, int err) {
  throw Error(ErrorKind::Setup, -1,
              "shared-memory segment " + name + ": " + call + " failed: " + std::system_category().message(err));
}

unsigned long long mib_rounded_up(unsigned long long bytes) { return bytes / kMiB + (bytes % kMiB != 0); }

// Closes the descriptor on every path out of create() and open(); the mapping outlives it.
class ScopedFd {
 public:
  explicit ScopedFd(int fd) noexcept : fd_(fd) {}
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ~ScopedFd() { ::close(fd_); }

 private:
  int fd_;
};

bool is_lower_hex(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

void check_name(const std::string& name) {
  if (!is_segment_name(name)) {
    throw std::invalid_argument("invalid shared-memory segment name '" + name +
                                "': expected /accel-<16 to 64 lowercase hex digits>-r<rank>");
  }
}

// Fails early with a message saying what to do, instead of a SIGBUS on first touch of a page that tmpfs
// cannot provide.
void check_free_space(size_t bytes) {
  struct statvfs fs {};
  if (::statvfs("/dev/shm", &fs) != 0) throw_system("/dev/shm", "statvfs", errno);
  const unsigned long long free_bytes = static_cast<unsigned long long>(fs.f_bavail) * fs.f_frsize;
  if (bytes <= free_bytes && free_bytes - bytes >= kFreeSpaceMargin) return;
  throw Error(ErrorKind::Setup, -1,
              "shared-memory transport needs " + std::to_string(mib_rounded_up(bytes) + 1) +
                  " MiB in /dev/shm, only " + std::to_string(free_bytes / kMiB) +
                  " MiB free; set ACCEL_TRANSPORT=torch or free /dev/shm");
}

// shm_open applies the umask, which can only narrow 0600 (say to 0400); peers then could not map the segment
// read-write, so narrowed bits are restored. Anything else than 0600 afterwards is refused.
void make_owner_only(int fd, const std::string& name) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw_system(name, "fstat", errno);
  if ((st.st_mode & 0777) == kOwnerOnly) return;
  if (::fchmod(fd, kOwnerOnly) != 0) throw_system(name, "fchmod", errno);
  if (::fstat(fd, &st) != 0) throw_system(name, "fstat", errno);
  if ((st.st_mode & 0777) != kOwnerOnly) {
    throw Error(ErrorKind::Setup, -1, "shared-memory segment " + name + " has mode " +
                                          std::to_string(st.st_mode & 0777) + " instead of owner-only 0600");
  }
}

// posix_fallocate makes tmpfs hand out every page now: running out of /dev/shm fails here, not later as a
// SIGBUS in whichever rank first touches a missing page.
void reserve_pages(int fd, const std::string& name, size_t bytes) {
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) throw_system(name, "ftruncate", errno);
  const int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  if (err == ENOSPC) {
    throw Error(ErrorKind::Setup, -1,
                "shared-memory transport could not reserve " + std::to_string(mib_rounded_up(bytes)) +
                    " MiB in /dev/shm (no space left); set ACCEL_TRANSPORT=torch or free /dev/shm");
  }
  if (err != 0) throw_system(name, "posix_fallocate", err);
}

// A peer's segment must be exactly the size both sides computed, and owner-only of this user: anything else
// is a segment of another group, another build, or someone else's.
void check_peer_segment(int fd, const std::string& name, size_t expected_bytes) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw_system(name, "fstat", errno);
  if (st.st_uid != ::geteuid() || (st.st_mode & 0777) != kOwnerOnly) {
    throw Error(ErrorKind::Setup, -1, "shared-memory segment " + name +
                                          " is not an owner-only (0600) segment of this user; refusing to map it");
  }
  if (static_cast<unsigned long long>(st.st_size) != expected_bytes) {
    throw Error(ErrorKind::Setup, -1,
                "shared-memory segment " + name + " has " + std::to_string(st.st_size) + " bytes, expected " +
                    std::to_string(expected_bytes) + " (do all ranks use the same slot size?)");
  }
}

// One mapping per file per process, so that ranks sharing a process (threads in the C++ tests) see each
// segment at one address. ThreadSanitizer tracks addresses: across two mappings of one segment it would see
// neither the synchronisation nor the races of the protocol. Keyed by inode, not name: names can be reused.
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
    void* addr = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (addr == MAP_FAILED) throw_system(name, "mmap", errno);
    std::shared_ptr<std::byte> mapping(static_cast<std::byte*>(addr),
                                       [bytes](std::byte* data) { ::munmap(data, bytes); });
    entry = mapping;
    return mapping;
  }

 private:
  using FileId = std::pair<dev_t, ino_t>;

  void forget_unmapped() {
    for (auto it = mappings_.begin(); it != mappings_.end();) {
      it = it->second.expired() ? mappings_.erase(it) : std::next(it);
    }
  }

  std::mutex mutex_;
  std::map<FileId, std::weak_ptr<std::byte>> mappings_;
};

}  // namespace

bool is_segment_name(const std::string& name) {
  const std::string prefix = "/accel-";
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
  check_free_space(bytes);
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, kOwnerOnly);
  if (fd < 0) throw_system(name, "shm_open(O_CREAT | O_EXCL)", errno);
  ScopedFd guard(fd);
  try {
    make_owner_only(fd, name);
    reserve_pages(fd, name, bytes);
    return Segment(name, MappingRegistry::instance().map(fd, name, bytes), bytes, /*creator=*/true);
  } catch (...) {
    ::shm_unlink(name.c_str());
    throw;
  }
}

Segment Segment::open(const std::string& name, size_t expected_bytes) {
  check_name(name);
  const int fd = ::shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0 && errno == ENOENT) {
    throw Error(ErrorKind::Setup, -1, "shared-memory segment " + name + " does not exist");
  }
  if (fd < 0) throw_system(name, "shm_open", errno);
  ScopedFd guard(fd);
  check_peer_segment(fd, name, expected_bytes);
  return Segment(name, MappingRegistry::instance().map(fd, name, expected_bytes), expected_bytes,
                 /*creator=*/false);
}

Segment::Segment(std::string name, std::shared_ptr<std::byte> mapping, size_t size, bool creator) noexcept
    : name_(std::move(name)),
      mapping_(std::move(mapping)),
      size_(size),
      creator_pid_(creator ? ::getpid() : 0),
      linked_(creator) {}

Segment::Segment(Segment&& other) noexcept
    : name_(std::move(other.name_)),
      mapping_(std::move(other.mapping_)),
      size_(std::exchange(other.size_, 0)),
      creator_pid_(std::exchange(other.creator_pid_, 0)),
      linked_(std::exchange(other.linked_, false)) {}

Segment& Segment::operator=(Segment&& other) noexcept {
  if (this != &other) {
    release();
    name_ = std::move(other.name_);
    mapping_ = std::move(other.mapping_);
    size_ = std::exchange(other.size_, 0);
    creator_pid_ = std::exchange(other.creator_pid_, 0);
    linked_ = std::exchange(other.linked_, false);
  }
  return *this;
}

Segment::~Segment() { release(); }

// A creator that never unlinked (setup failed before every peer attached) removes the name, so that no
// failure path leaks a segment. Only the creating process does: a forked child (a DataLoader worker, say)
// that inherited the Segment must not remove the name under its parent's peers.
void Segment::release() noexcept {
  mapping_.reset();  // unmaps with the last Segment of this process on the file
  if (linked_ && creator_pid_ == ::getpid()) ::shm_unlink(name_.c_str());
  linked_ = false;
}

void Segment::unlink() {
  if (creator_pid_ == 0) {
    throw Error(ErrorKind::Usage, -1, "shared-memory segment " + name_ + " can only be unlinked by its creator");
  }
  if (!linked_) return;
  if (::shm_unlink(name_.c_str()) != 0 && errno != ENOENT) throw_system(name_, "shm_unlink", errno);
  linked_ = false;
}

}  // namespace accel::shm
